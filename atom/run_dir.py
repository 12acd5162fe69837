"""A run directory holds one run: config.json, metrics.jsonl and checkpoints/step_*.

Which directory a command writes into (a new run never mixes into another's; --resume
continues in the resumed run's own directory, whichever of its folders was named), and
what continuing a run from a step does to the files after that step: their records leave
metrics.jsonl and newer checkpoints are set aside, so that the run's newest checkpoint is
always the one this run wrote last and a later --resume continues it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from atom.checkpoint import CHECKPOINTS_DIR, list_checkpoints, step_of
from atom.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_RUN = Path("runs/default")
METRICS = "metrics.jsonl"
SET_ASIDE = "superseded"  # under checkpoints/: where a resume from an older step puts newer ones


def holds_run(directory: Path) -> bool:
    return (directory / METRICS).exists() or bool(list_checkpoints(directory))


def run_of(resume: Path) -> Path:
    """The run directory a --resume path belongs to: the path itself, or the run above its
    checkpoints/ folder or one of its step_* checkpoints."""
    if step_of(resume) is not None and resume.parent.name == CHECKPOINTS_DIR:
        return resume.parent.parent
    if resume.name == CHECKPOINTS_DIR and list_checkpoints(resume):
        return resume.parent
    return resume


def choose(out: str | None, resume: str | None, restart_hint: str = "") -> Path:
    """The directory a train command writes into. `restart_hint` is added to the advice
    when a new run meets an old one (a peer's own flags, so the line says what works)."""
    if resume:
        resumed = run_of(Path(resume))
        target = Path(out) if out else resumed
        if target.resolve() != resumed.resolve() and holds_run(target):
            raise ConfigError(
                f"{target} holds another run; resume into {resumed} (leave out --out) or "
                "give a new --out"
            )
        return target
    target = Path(out) if out else DEFAULT_RUN
    if holds_run(target):
        raise ConfigError(
            f"{target} already holds a run (metrics.jsonl, checkpoints/); continue it with "
            f"`atom train --resume {target}{restart_hint}`, or start a new one with another "
            "--out"
        )
    return target


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
