"""The docs stay true: every command block in README.md and docs/*.md is run here (on tiny
settings) or says why it is not, every transcript is what its command prints today, the
synopsis names every option, and the configuration reference is what the config
dataclasses say.

A block is marked on a line above it:
    <!-- doc-test: run -->                       run as written, in a fresh directory
    <!-- doc-test: run with atom train ARGS -->  ... with ARGS added to every `atom train`
    <!-- doc-test: skip: REASON -->              not run, and why
    <!-- doc-test: synopsis -->                  lists every option of every command
    <!-- doc-test: output of COMMAND -->         the block is what COMMAND prints
and a page can say `<!-- doc-test: skip-file: REASON -->` once. A run block runs under
bash with `set -e` in a directory holding what the docs' examples name (my_texts/,
corpus.txt, a tokenizer, a stand-in Hugging Face checkpoint at ~/models/Qwen2-0.5B: HOME
is that directory); `pip install` lines are not run (the test environment has every
extra). `$ ` lines are transcripts, and so are output blocks: tools/doc_transcripts.py
finds them, runs them, and compares (figures within 1%, words and lines equal; figures
masked where the mark says they vary). `python -m tools.doc_transcripts --write` rewrites
them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import doc_transcripts
from tools.doc_transcripts import MARK, PAGES, ROOT, Block, command_text, joined


def _blocks(page: Path) -> list[Block]:
    return doc_transcripts.blocks(page)


def _all_blocks() -> list[Block]:
    out = []
    for page in PAGES:
        whole = MARK.search(page.read_text())
        if whole and whole.group(1) == "skip-file":
            continue
        out += _blocks(page)
    return out


def _run_blocks() -> list[Block]:
    """Run blocks with a command besides their transcripts (those run in the test below)."""
    return [b for b in _all_blocks() if b.mark == "run" and _script(b).strip() != "set -e"]


def test_every_command_block_is_run_or_says_why_not():
    unmarked = [b.where for b in _all_blocks() if b.mark is None]
    assert unmarked == [], f"command blocks with no doc-test marker: {unmarked}"
    vague = [b.where for b in _all_blocks() if b.mark == "skip" and len(b.detail) < 12]
    assert vague == [], f"a skipped block says why: {vague}"
    for page in PAGES:
        whole = MARK.search(page.read_text())
        if whole and whole.group(1) == "skip-file":
            assert len(whole.group(2)) >= 12, page


def test_the_synopsis_names_every_option():
    """Each command's line(s) in the synopsis list every option its --help has."""
    from atom.cli import build_parser

    [block] = [b for b in _all_blocks() if b.mark == "synopsis"]
    said: dict[str, str] = {}
    command = None
    for line in block.body:
        m = re.match(r"atom (\w+)", line)
        if m:
            command = m.group(1)
        if command:
            said[command] = said.get(command, "") + " " + line
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = []
    for name, parser in sub.choices.items():
        for action in parser._actions:
            longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if longs and not any(o in said.get(name, "") for o in longs):
                missing.append(f"atom {name} {longs[0]}")
    assert missing == [], f"the synopsis ({block.where}) lacks {missing}"


def test_the_config_list_names_every_config():
    """getting-started's `--config` line and the CLI's help name every file in configs/ (two
    were missing from the docs' list, issue 42)."""
    from atom.cli import build_parser
    from atom.config import config_names

    page = (ROOT / "docs" / "getting-started.md").read_text()
    [item] = [p for p in page.split("\n- ") if p.startswith("`--config` takes")]
    assert sorted(set(re.findall(r"`([\w.-]+)`", item)) - {"--config", "configs/"}) == (
        config_names()
    ), "the --config list in docs/getting-started.md"
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    [config] = [a for a in sub.choices["train"]._actions if "--config" in a.option_strings]
    assert all(name in config.help for name in config_names())


def test_the_config_reference_is_generated_and_complete():
    """docs/config.md is what tools/config_reference.py writes: a key added without a line
    in atom/config/describe.py (or a changed default) fails here."""
    from atom.config.describe import DESCRIPTIONS
    from tools import config_reference

    keys = [k for k, _ in config_reference.config_keys()]
    assert sorted(set(keys) - set(DESCRIPTIONS)) == [], "keys with no description"
    assert sorted(set(DESCRIPTIONS) - set(keys)) == [], "descriptions of keys that are gone"
    assert config_reference.PAGE.read_text() == config_reference.render(), (
        "docs/config.md is stale: run python -m tools.config_reference"
    )


# ------------------------------------------------------------------ running the blocks
def _world(tmp: Path) -> dict[str, str]:
    """The files the docs' examples name, and the environment they run in."""
    (tmp / "my_texts").mkdir()
    text = (ROOT / "docs" / "architecture.md").read_text()
    (tmp / "my_texts" / "notes.md").write_text(text)
    (tmp / "corpus.txt").write_text(text)
    (tmp / "notes").mkdir()
    (tmp / "notes" / "notes.md").write_text(text)
    shutil.copytree(ROOT / "docs" / "examples", tmp / "docs" / "examples")
    shutil.copy(ROOT / "docs" / "examples" / "chat.jsonl", tmp / "chats.jsonl")
    _tokenizer(tmp / "path" / "to")
    env = {**os.environ, "HOME": str(tmp), "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json (and its config) trained on a few lines."""
    pytest.importorskip("tokenizers")
    from tests.bpe_util import byte_level_bpe, save_tokenizer

    directory.mkdir(parents=True)
    words = (ROOT / "docs" / "architecture.md").read_text().split()[:400]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    tok = byte_level_bpe(lines, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    save_tokenizer(tok, directory, {"eos_token": "<|endoftext|>"})
    return directory


def _stand_in_checkpoint(home: Path) -> None:
    """~/models/Qwen2-0.5B: a tiny Qwen2 with a real BPE tokenizer."""
    from tests import test_hf

    test_hf.save_hf("qwen2", home / "models" / "Qwen2-0.5B", _tokenizer(home / "tok"))


def _script(block: Block) -> str:
    """The block as a bash script: its commands up to the first `$ ` line (that and what
    follows are transcripts: tools/doc_transcripts)."""
    extra = ""
    if block.detail.startswith("with atom train "):
        extra = block.detail.removeprefix("with atom train ")
    commands = []
    for _, line in joined(block.body):
        text = command_text(line)
        if line.startswith("$ "):
            break
        if not text or text.startswith(("#", "pip ")):
            continue
        if extra and text.startswith("atom train"):
            text += " " + extra
        commands.append(text)
    return "set -e\n" + "\n".join(commands) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("block", _run_blocks(), ids=lambda b: b.where)
def test_documented_commands_run(block, tmp_path):
    env = _world(tmp_path)
    if "~/models/Qwen2-0.5B" in "\n".join(block.body):
        pytest.importorskip("transformers")
        _stand_in_checkpoint(tmp_path)
    script = _script(block)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"{block.where}:\n{script}\n{proc.stderr[-3000:]}"


def _transcript_params() -> list:
    """Each is slow (a stated card's profile searches for seconds; README's tables are
    checked on one card, not six); peers that run for a while are multiprocess too."""
    return [
        pytest.param(t, id=t.where, marks=[pytest.mark.slow, *[pytest.mark.multiprocess] * t.slow])
        for t in doc_transcripts.transcripts()
    ]


@pytest.mark.parametrize("transcript", _transcript_params())
def test_transcripts_are_what_their_commands_print(transcript, tmp_path):
    """issue 42: a transcript showed 1,473 plans and a 4,899 tokens/s winner long after the
    command printed 1,819 and 5,402, another plan: only the exit status was checked."""
    said = doc_transcripts.check(transcript, tmp_path)
    assert said == [], (
        f"{transcript.where}: `{transcript.command}` prints otherwise (refresh it with "
        "python -m tools.doc_transcripts --write):\n" + "\n".join(said)
    )


def test_a_transcript_is_compared_by_its_figures_and_its_shape():
    """Figures within 1% where the output is deterministic; masked where the mark says
    they vary, and then a `-` (not measured yet), units and fingerprints too."""
    from tools.doc_transcripts import Transcript, differences

    def t(shown, vary=False):
        return Transcript("x", ROOT, "cmd", shown, 0, "", [], [], vary=vary)

    plan = ["| 1 | 16 | 3 | fp32 | 13.379 | 4,899 | compute |"]
    assert differences(t(plan), ["| 1 | 16 | 3 | fp32 | 13.38 | 4,900 | compute |"]) == []
    assert differences(t(plan), ["| 1 | 3 | 1 | fp32 | 11.992 | 5,465 | bus |"]) != []
    assert differences(t(plan), ["| 1 | 16 | 3 | fp32 | 13.379 | 4,899 | bus |"]) != []
    assert differences(t(plan), [*plan, "atom: wrote plan.json"]) != []
    peers = ["bob   alive   161   233.0 Mb/s   4.2 ms   0.1s ago   3.0e-03 key:ecbc1c8adcfb7193"]
    now = ["bob   alive   184            -   1.2 s   12s ago   3.5e-05 key:d6c82d3d06412ed8"]
    assert differences(t(peers, vary=True), now) == []
    assert differences(t(peers, vary=True), [now[0].replace("alive", "dead")]) != []
    assert differences(t(peers), now) != []


def test_every_relative_link_leads_to_a_file():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if not path or re.match(r"^[a-z]+:", path):
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_what_the_readme_commands_write_is_ignored_by_git():
    """runs/ (the default run), keys/ (secret keys), data/ (prepared datasets), plan.json."""
    proc = subprocess.run(["git", "check-ignore", "runs/default/x", "keys/alice/a.key_secret",
                           "data/mine/meta.json", "plan.json"], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert len(proc.stdout.split()) == 4, proc.stdout
