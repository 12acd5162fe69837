"""A run directory holds one run: config.json, metrics.jsonl and checkpoints/step_*.

Which directory a command writes into (a new run never mixes into another's; --resume
continues in the resumed run's own directory, whichever of its folders was named), and
what continuing a run from a step does to the files after that step: their records leave
metrics.jsonl and newer checkpoints are set aside, so that the run's newest checkpoint is
always the one this run wrote last and a later --resume continues it.

One process at a time writes a run directory: the command claims it (RunLock, an flock
on run.lock held for the command's life) before it checks or writes anything, and a
second process is refused with the holder's PID.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time
from pathlib import Path

from atom.ground.errors import ConfigError
from atom.store.checkpoint import CHECKPOINTS_DIR, list_checkpoints, step_of

log = logging.getLogger(__name__)

DEFAULT_RUN = Path("runs/default")
METRICS = "metrics.jsonl"
SET_ASIDE = "superseded"  # under checkpoints/: where a resume from an older step puts newer ones
LOCK = "run.lock"  # the claim: "PID command" of the process writing the run
HOLDER_WAIT_S = 1.0  # a holder that has just locked writes its PID within moments


class RunLock:
    """A run directory claimed by this process until release() (or its death).

    flock, not a PID file: the kernel drops the lock when its process dies however it
    dies (SIGKILL, OOM, a power cut), so a stale claim is never mistaken for a live one
    and the next command simply takes it. The file itself stays (unlinking a lock file
    others may have open lets two processes hold "the" lock at once), except in a
    directory the claim itself created and nothing else wrote: a refused or failed
    command leaves no empty run behind.
    """

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self._fd, self._created = path, fd, created

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._created and [p.name for p in self.path.iterdir()] == [LOCK]:
                (self.path / LOCK).unlink()  # while still held: nobody else got it meanwhile
                for d in self._created:  # innermost first; one holding anything else stays
                    d.rmdir()
        except OSError:
            pass
        finally:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim(run: Path, elsewhere: str = "give another --out") -> RunLock:
    """Claim `run` (created if need be) for this process, or refuse (ConfigError) naming
    the process that holds it; `elsewhere` says how to write somewhere else instead."""
    run = Path(run)
    created = [d for d in (run, *run.parents) if not d.exists()]
    run.mkdir(parents=True, exist_ok=True)
    fd = os.open(run / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        pid, _, command = holder.partition(" ")
        who = f"PID {pid}: {command}" if holder else "a process that is just starting"
        raise ConfigError(
            f"{run} is in use by another atom process ({who}); wait for it to end, stop it "
            f"(kill {pid or 'PID'}; a training saves a checkpoint first), or {elsewhere}"
        ) from None
    program = Path(sys.argv[0]).name if sys.argv else "atom"
    program = "atom" if program == "__main__.py" else program  # python -m atom.cli
    command = " ".join([program, *sys.argv[1:]])
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {command[:200]}\n".encode(), 0)
    return RunLock(run, fd, created)


def _holder(fd: int) -> str:
    """The holder's "PID command", as it wrote it after locking (waited for a moment: a
    holder that has just taken the lock may not have written it yet)."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
        if text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def holds_run(directory: Path) -> bool:
    return (directory / METRICS).exists() or bool(list_checkpoints(directory))


def enclosing_run(path: Path) -> Path | None:
    """The run directory `path` lies in (itself or an ancestor holding a run), if any: a
    command writing there claims that run too."""
    for d in (path, *path.parents):
        if d.is_dir() and holds_run(d):
            return d
    return None


def run_of(resume: Path) -> Path:
    """The run directory a --resume path belongs to: the path itself, or the run above its
    checkpoints/ folder or one of its step_* checkpoints."""
    if step_of(resume) is not None and resume.parent.name == CHECKPOINTS_DIR:
        return resume.parent.parent
    if resume.name == CHECKPOINTS_DIR and list_checkpoints(resume):
        return resume.parent
    return resume


def choose(out: str | None, resume: str | None, restart_hint: str = "") -> RunLock:
    """The directory a train command writes into, claimed for the command's life (its
    `.path`). Claimed first, checked after: a run another process is writing is refused
    as that, not as a finished run to resume. `restart_hint` is added to the advice when
    a new run meets an old one (a peer's own flags, so the line says what works)."""
    resumed = run_of(Path(resume)) if resume else None
    target = Path(out) if out else resumed or DEFAULT_RUN
    lock = claim(target)
    try:
        if resumed is not None and target.resolve() != resumed.resolve() and holds_run(target):
            raise ConfigError(
                f"{target} holds another run; resume into {resumed} (leave out --out) or "
                "give a new --out"
            )
        if resumed is None and holds_run(target):
            raise ConfigError(
                f"{target} already holds a run (metrics.jsonl, checkpoints/); continue it "
                f"with `atom train --resume {target}{restart_hint}`, or start a new one with "
                "another --out"
            )
    except BaseException:
        lock.release()
        raise
    return lock


def continue_from(run: Path, step: int) -> list[Path]:
    """Continue `run` after `step`: drop the records of later steps from metrics.jsonl (they
    are trained again) and move checkpoints of later steps to checkpoints/superseded/ (kept,
    not listed: otherwise a later --resume would pick them over what this run saves).
    Returns where the set-aside checkpoints went."""
    trim_metrics(run / METRICS, step)
    moved = []
    for ckpt in list_checkpoints(run):
        if step_of(ckpt) <= step:
            continue
        aside = ckpt.parent / SET_ASIDE
        aside.mkdir(exist_ok=True)
        target, n = aside / ckpt.name, 1
        while target.exists():  # set aside before, by another resume: keep both
            target, n = aside / f"{ckpt.name}.{n}", n + 1
        ckpt.rename(target)
        moved.append(target)
    if moved:
        log.warning(
            "continuing %s from step %d: its newer checkpoint(s) %s were set aside in %s "
            "(this run's own saves are what a later --resume continues; delete them when "
            "you no longer need them)",
            run, step, ", ".join(p.name.split(".")[0] for p in moved), moved[0].parent,
        )  # fmt: skip
    return moved


def trim_metrics(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            pass  # a line cut short by a killed run
    path.write_text("".join(line + "\n" for line in kept))
