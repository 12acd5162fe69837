"""The transcripts in README.md and docs/*.md are what their commands print today: this
finds them, runs them and compares, or rewrites them; tests/test_docs.py runs the same
comparison, so a transcript that drifts from the code fails there.

    python -m tools.doc_transcripts            # compare every transcript; exit 1 if one differs
    python -m tools.doc_transcripts --write    # rewrite them with what the commands print now
    python -m tools.doc_transcripts --only getting-started   # those whose place has this

A transcript is either
- a `$ COMMAND` line in a block marked `<!-- doc-test: run -->` and the lines under it, up
  to the next `$ ` line: what COMMAND prints, stdout and stderr together as a terminal
  shows them (the block's other commands run first); or
- the block under `<!-- doc-test: output of COMMAND -->` (fenced, indented, or a markdown
  table): what COMMAND prints, whole.
After `;` the mark of an output may say:
- `N s into the block above`: the command block above runs first (its `... &` lines keep
  running) and COMMAND, which that block names on a line of its own, runs N s in; the
  block's lines after it (a `kill`) run next. Fixed loopback ports are run on free ones.
- `figures vary`: figures (and key fingerprints) are masked and the shape is compared:
  the lines, their words, the order of the rows. Otherwise (a stated card's plan is
  deterministic) each figure must be within FIGURES_REL of the one shown, and the words
  equal.
- `checked with ARGS`: the test runs COMMAND with ARGS added (a part of it that is
  cheaper) and compares each line printed with the shown line that begins the same way.
Each command runs in a fresh directory that is also its HOME (no cache from this
machine), and its exit status must be 2 where an `atom: error:` line is shown, else 0.
benchmarks.md is not read: its figures are dated records of runs of minutes to hours.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- doc-test: (skip-file|run|skip|synopsis|output)\b:?\s*(.*?)\s*-->")
COMMAND = re.compile(r"^(\$ )?(atom |python|pip |PYTHONPATH=|sudo |[a-z]+\$ )")
FIGURES_REL = 0.01  # a deterministic figure may move this much (float sums across builds)
TIMEOUT_S = 300  # a transcript's command, at most
FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
HEX = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b")
UNIT = re.compile(r"#\s?(?:ms|s|min|h|[kMGT]?i?B|[kMG]?b/s)(?![\w/])|(?<!\S)-(?!\S)")


@dataclass
class Block:
    """A code block of a page: its lines, where they are, and the doc-test mark above it."""

    page: Path
    line: int  # 1-based line of the block's first line (its fence, for a fenced block)
    first: int  # 0-based line of the first body line
    indent: str  # "    " for an indented block, "" for a fenced one
    body: list[str]
    mark: str | None  # run | skip | synopsis | output (None: unmarked)
    detail: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def block_at(lines: list[str], i: int) -> tuple[int, str, list[str], int] | None:
    """(first body line, indent, body, the line after it) of a block starting at line i."""
    if lines[i].startswith("```"):
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        return i + 1, "", lines[i + 1 : j], j + 1
    if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
        j = i
        while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
            j += 1
        body = [x[4:] for x in lines[i:j]]
        while body and not body[-1].strip():
            body.pop()
        return i, "    ", body, j
    if lines[i].startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        return i, "", lines[i:j], j
    return None


def blocks(page: Path, commands_only: bool = True) -> list[Block]:
    """The page's code blocks (and tables): with `commands_only`, those holding a command."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        at = block_at(lines, i)
        if at is None:
            i += 1
            continue
        start = i
        first, indent, body, i = at
        if commands_only and not any(COMMAND.match(b) for b in body):
            continue
        above = [x for x in lines[max(0, start - 3) : start] if x.strip()]
        m = MARK.search(above[-1]) if above else None
        found.append(Block(page, start + 1, first, indent, body, m.group(1) if m else None,
                           m.group(2) if m else ""))  # fmt: skip
    return found


def joined(body: list[str]) -> list[tuple[int, str]]:
    """(index of its last line, line) with `\\` continuations joined."""
    out, line = [], ""
    for k, raw in enumerate(body):
        line += raw
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        out.append((k, line))
        line = ""
    return out


def command_text(line: str) -> str:
    """A shell line as the docs' scripts run it: comments after `  #` dropped."""
    return line.split("  #")[0].strip() if not line.startswith("python -c") else line


@dataclass
class Transcript:
    where: str
    page: Path
    command: str
    shown: list[str]
    first: int  # 0-based line of the page where the shown lines begin
    indent: str
    setup: list[str]  # commands run before, in the same shell
    after: list[str]  # commands run after it (a wait > 0: stopping the block above)
    wait_s: float = 0.0
    vary: bool = False
    check_args: str = ""

    @property
    def slow(self) -> bool:
        """It runs processes in the background for a while."""
        return self.wait_s > 0


def _run_transcripts(block: Block) -> list[Transcript]:
    """The `$ ` lines of a run block, with the lines each prints."""
    found, setup = [], []
    for at, line in joined(block.body):
        if line.startswith("$ "):
            found.append(Transcript(f"{block.page.relative_to(ROOT)}:{block.first + at + 1}",
                                    block.page, line[2:], [], block.first + at + 1,
                                    block.indent, list(setup), []))  # fmt: skip
        elif found:
            found[-1].shown.append(line)
        elif command_text(line) and not command_text(line).startswith(("#", "pip ")):
            setup.append(command_text(line))
    return found


def _output_transcript(page: Path, lines: list[str], i: int, detail: str) -> Transcript:
    """The block under an `output of COMMAND; ...` mark at line i."""
    parts = [p.strip() for p in detail.removeprefix("of").split(";")]
    t = Transcript(f"{page.relative_to(ROOT)}:{i + 1}", page, parts[0], [], 0, "", [], [])
    j = i + 1
    while not lines[j].strip():
        j += 1
    t.first, t.indent, t.shown, _ = block_at(lines, j)
    for option in parts[1:]:
        if m := re.fullmatch(r"(\d+) s into the block above", option):
            t.wait_s = float(m.group(1))
            [above] = [b for b in blocks(page) if b.first < i][-1:]
            script = [command_text(x) for _, x in joined(above.body)]
            cut = script.index(t.command)  # the block names the command on a line of its own
            t.setup, t.after = [x for x in script[:cut] if x], [x for x in script[cut + 1 :] if x]
        elif option == "figures vary":
            t.vary = True
        elif option.startswith("checked with "):
            t.check_args = option.removeprefix("checked with ")
        else:
            raise ValueError(f"{t.where}: unknown option {option!r} in the output mark")
    return t


def transcripts(pages: list[Path] = PAGES) -> list[Transcript]:
    found = []
    for page in pages:
        text = page.read_text()
        whole = MARK.search(text)
        if whole and whole.group(1) == "skip-file":
            continue
        found += [t for b in blocks(page) if b.mark == "run" for t in _run_transcripts(b)]
        lines = text.split("\n")
        for i, line in enumerate(lines):
            m = MARK.search(line)
            if m and m.group(1) == "output":
                found.append(_output_transcript(page, lines, i, m.group(2)))
    return found


# ------------------------------------------------------------------------------ running
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the session the command ran in (a peer saves and says goodbye), then
    SIGKILL to what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.1)


def produce(t: Transcript, workdir: Path, check: bool = False) -> tuple[int, list[str]]:
    """(exit status, lines printed) of the transcript's command, run in `workdir` (its
    HOME too) after its setup; with `check`, the cheaper command its mark names."""
    command = f"{t.command} {t.check_args}" if check and t.check_args else t.command
    if "|" in t.command and check and t.check_args:  # the arguments go before a pipe
        head, tail = t.command.split("|", 1)
        command = f"{head.rstrip()} {t.check_args} |{tail}"
    out = workdir / "transcript.out"
    script = "\n".join(
        [*t.setup, *( [f"sleep {t.wait_s:g}"] if t.wait_s else []),
         f"( {command} ) > {out} 2>&1; echo $? > {out}.rc", *t.after, "wait"]
    )  # fmt: skip
    ports = {p: _free_port() for p in set(re.findall(r"127\.0\.0\.1:(\d{4,5})", script))}
    for old, new in ports.items():
        script = script.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    env = {k: v for k, v in os.environ.items() if k != "ATOM_CACHE"}
    env.update(HOME=str(workdir), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # fmt: skip
    with open(workdir / "setup.log", "wb") as log:
        proc = subprocess.Popen(["bash", "-c", script], cwd=workdir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=TIMEOUT_S + t.wait_s)
        finally:  # whatever the block started and left running ends here
            _end_group(proc)
    if not (workdir / f"{out.name}.rc").exists():
        raise RuntimeError(f"{t.where}: `{command}` did not run:\n"
                           + (workdir / "setup.log").read_text()[-3000:])  # fmt: skip
    text = out.read_text()
    for old, new in ports.items():
        text = text.replace(f"127.0.0.1:{new}", f"127.0.0.1:{old}")
    lines = text.rstrip("\n").split("\n") if text.strip() else []
    return int((workdir / f"{out.name}.rc").read_text()), [x.rstrip() for x in lines]


# ---------------------------------------------------------------------------- comparing
def shape(line: str, vary: bool) -> tuple[str, list[float]]:
    """The line's words with its figures as `#`, and the figures. With `vary`, a figure's
    unit (`4.2 ms` or `1.2 s`, `kB` or `MB`), a `-` standing for a figure not known yet
    and key fingerprints are masked too."""
    if vary:
        line = HEX.sub("<hex>", line)
    figures = [float(f.replace(",", "")) for f in FIGURE.findall(line)]
    words = FIGURE.sub("#", line)
    if vary:
        words = UNIT.sub("#", words)
    return " ".join(words.split()), figures


def _same(shown: str, printed: str, vary: bool) -> bool:
    (a, x), (b, y) = shape(shown, vary), shape(printed, vary)
    if a != b:
        return False
    close = (abs(u - v) <= FIGURES_REL * max(abs(u), abs(v)) for u, v in zip(x, y, strict=True))
    return vary or all(close)


def differences(t: Transcript, printed: list[str], part: bool = False) -> list[str]:
    """What differs between the shown lines and the printed ones; [] when they agree.
    `part`: the printed lines are a part (checked with ARGS): each is compared with the
    shown line that begins the same way (a table's first cell, a line's first words)."""
    said = []
    if part:

        def key(line: str) -> str:
            return line.split("|")[1].strip() if line.startswith("|") else shape(line, True)[0]

        shown = {key(s): s for s in t.shown}
        for p in printed:
            s = shown.get(key(p))
            if s is None or not _same(s, p, t.vary):
                said.append(f"printed {p!r}\n  shown   {s!r}")
        return said
    for k in range(max(len(t.shown), len(printed))):
        s = t.shown[k] if k < len(t.shown) else None
        p = printed[k] if k < len(printed) else None
        if s is None or p is None or not _same(s, p, t.vary):
            said.append(f"line {k + 1}: shown   {s!r}\n  printed {p!r}")
    return said


def check(t: Transcript, workdir: Path) -> list[str]:
    """What is wrong with the transcript: its exit status and the lines that differ."""
    rc, printed = produce(t, workdir, check=True)
    want = 2 if any(s.startswith("atom: error:") for s in t.shown) else 0
    said = [f"exit status {rc}, expected {want}"] if rc != want else []
    return said + differences(t, printed, part=bool(t.check_args))


def write(found: list[Transcript]) -> None:
    """Each transcript's shown lines replaced by what its command prints (from the end of
    each page backwards, so that the places found stay right)."""
    for t in sorted(found, key=lambda t: (str(t.page), -t.first)):
        with tempfile.TemporaryDirectory() as tmp:
            rc, printed = produce(t, Path(tmp))
        lines = t.page.read_text().split("\n")
        lines[t.first : t.first + len(t.shown)] = [(t.indent + p) if p else "" for p in printed]
        t.page.write_text("\n".join(lines))
        print(f"{t.where}: {len(printed)} lines (exit status {rc}): {t.command}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the transcripts")
    ap.add_argument("--only", default="", help="those whose page:line or command has this")
    args = ap.parse_args(argv)
    found = [t for t in transcripts() if args.only in f"{t.where} {t.command}"]
    if args.write:
        write(found)
        return 0
    stale = 0
    for t in found:
        with tempfile.TemporaryDirectory() as tmp:
            said = check(t, Path(tmp))
        print(f"{t.where}: {'ok' if not said else 'differs'}: {t.command}")
        for line in said:
            print(f"  {line}")
        stale += bool(said)
    if stale:
        print(f"{stale} transcript(s) differ: python -m tools.doc_transcripts --write")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
