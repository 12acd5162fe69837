"""The docs stay true: every command block in README.md and docs/*.md is run here (on tiny
settings) or says why it is not, the synopsis names every option, and the configuration
reference is what the config dataclasses say.

A block is marked on a line above it:
    <!-- doc-test: run -->                       run as written, in a fresh directory
    <!-- doc-test: run with atom train ARGS -->  ... with ARGS added to every `atom train`
    <!-- doc-test: skip: REASON -->              not run, and why
    <!-- doc-test: synopsis -->                  lists every option of every command
and a page can say `<!-- doc-test: skip-file: REASON -->` once. A run block runs under
bash with `set -e` in a directory holding what the docs' examples name (my_texts/,
corpus.txt, a tokenizer, a stand-in Hugging Face checkpoint at ~/models/Qwen2-0.5B: HOME
is that directory); `pip install` lines are not run (the test environment has every
extra). `$ ` lines are a transcript: the command runs, and its exit status and any
`atom: error:` line shown must match what it prints.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- doc-test: (skip-file|run|skip|synopsis)\b:?\s*(.*?)\s*-->")
COMMAND = re.compile(r"^(\$ )?(atom |python|pip |PYTHONPATH=|sudo |[a-z]+\$ )")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the block's first line
    body: list[str]
    mark: str | None  # run | skip | synopsis (None: unmarked)
    detail: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            start, body, i = i, lines[i + 1 : j], j + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            start, body, i = i, [x[4:] for x in lines[i:j]], j
            while body and not body[-1].strip():
                body.pop()
        else:
            i += 1
            continue
        if not any(COMMAND.match(b) for b in body):
            continue
        above = [x for x in lines[max(0, start - 3) : start] if x.strip()]
        m = MARK.search(above[-1]) if above else None
        found.append(Block(page, start + 1, body, m.group(1) if m else None,
                           m.group(2) if m else ""))  # fmt: skip
    return found


def _all_blocks() -> list[Block]:
    out = []
    for page in PAGES:
        whole = MARK.search(page.read_text())
        if whole and whole.group(1) == "skip-file":
            continue
        out += _blocks(page)
    return out


def _run_blocks() -> list[Block]:
    return [b for b in _all_blocks() if b.mark == "run"]


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


def _script(block: Block) -> tuple[str, list[tuple[str, list[str]]]]:
    """The block as a bash script, and its transcript (command, lines shown after it)."""
    joined, line = [], ""
    for raw in block.body:
        line += raw
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        joined.append(line)
        line = ""
    extra = ""
    if block.detail.startswith("with atom train "):
        extra = block.detail.removeprefix("with atom train ")
    commands, transcript = [], []
    for line in joined:
        text = line.split("  #")[0].strip() if not line.startswith("python -c") else line
        if line.startswith("$ "):
            transcript.append((line[2:], []))
            continue
        if transcript and not line.startswith("#"):
            transcript[-1][1].append(line)
            continue
        if not text or text.startswith("#") or text.startswith("pip "):
            continue
        if extra and text.startswith("atom train"):
            text += " " + extra
        commands.append(text)
    return "set -e\n" + "\n".join(commands) + "\n", transcript


@pytest.mark.slow
@pytest.mark.parametrize("block", _run_blocks(), ids=lambda b: b.where)
def test_documented_commands_run(block, tmp_path):
    env = _world(tmp_path)
    if "~/models/Qwen2-0.5B" in "\n".join(block.body):
        pytest.importorskip("transformers")
        _stand_in_checkpoint(tmp_path)
    script, transcript = _script(block)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"{block.where}:\n{script}\n{proc.stderr[-3000:]}"
    for command, shown in transcript:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        errors = [s for s in shown if s.startswith("atom: error:")]
        assert proc.returncode == (2 if errors else 0), f"{block.where}: {command}\n{proc.stderr}"
        for said in errors:  # the words before the first figure
            assert re.split(r"\d", said)[0] in proc.stderr, f"{block.where}: {said}"


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
