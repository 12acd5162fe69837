"""The soak's invariants (tools/soak.py), each a line in the report with its counts.

Checked while the group still runs (check): every peer not gone for good is up and
training; its resident memory, open files and threads flat over the second half of each
process's life; no traceback in any log; no memory-guard firing, rate-limit refusal or
other refusal between the peers outside the faults' own windows (a fault's window ends
RECOVER_S after it does); after each partition heals, every peer exchanges again with
the other half. After every peer was stopped (after_stop): each run directory's newest
checkpoint loads (sha256 verified) and holds no weight that is not finite or beyond
1e6; metrics.jsonl has one record per step, no gaps or repeats. With --reference: the
survivors' val loss within 5% of a fault-free group's at the same step.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tools.soak_faults import RECOVER_S

RSS_GROWTH = 0.05
MIN_LIFE_S = 60.0  # shorter lives say nothing about leaks
HEAL_S = 30.0  # a partition healed: both halves exchange again within this
COPIED = re.compile(r"copied parameters at step (\d+)")
WATCHED = ("guard.recycled", "rejected.")  # counters that must not move between honest peers


@dataclass
class Invariant:
    name: str
    ok: bool = True
    count: str = ""
    problems: list[str] = field(default_factory=list)

    def fail(self, problem: str) -> None:
        self.ok = False
        if len(self.problems) < 20:
            self.problems.append(problem)


@dataclass
class Report:
    invariants: list[Invariant] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def add(self, name: str) -> Invariant:
        inv = Invariant(name)
        self.invariants.append(inv)
        return inv

    # ------------------------------------------------------------ after the run
    def after_stop(self, soak, slots) -> None:
        self._checkpoints(slots)
        self._metrics(slots)

    def _checkpoints(self, slots) -> None:
        import torch

        from atom.checkpoint import list_checkpoints, load_checkpoint

        inv = self.add("newest checkpoint of every run directory loads, finite, |w| <= 1e6")
        n = 0
        for s in slots:
            for run in _runs(s):
                if not list_checkpoints(run):
                    continue
                n += 1
                try:
                    ckpt = load_checkpoint(run, verify=True)
                    worst = 0.0
                    for name in ckpt.names():
                        t = ckpt.get(name).float()
                        if not bool(torch.isfinite(t).all()):
                            inv.fail(f"{ckpt.path}: {name} not finite")
                        worst = max(worst, float(t.abs().max()) if t.numel() else 0.0)
                    if worst > 1e6:
                        inv.fail(f"{ckpt.path}: a weight of {worst:.3g}")
                except Exception as err:  # noqa: BLE001 (every way it fails is a finding)
                    inv.fail(f"{run}: {type(err).__name__}: {err}")
        inv.count = f"{n} run directories"

    def _metrics(self, slots) -> None:
        inv = self.add("metrics.jsonl: one record per step, no gaps or repeats (a jump only "
                       "where a restarted peer copied the group's step)")  # fmt: skip
        n = jumps = 0
        for s in slots:
            copied = set()  # a (re)joining peer takes the group's step: the next record
            for log in s.home.parent.glob(f"{s.home.name}-*.log"):
                copied |= {int(m) + 1 for m in COPIED.findall(log.read_text(errors="replace"))}
            for run in _runs(s):
                path = run / "metrics.jsonl"
                if not path.exists():
                    continue
                steps = []
                for i, line in enumerate(path.read_text().splitlines()):
                    try:
                        steps.append(json.loads(line)["step"])
                    except (json.JSONDecodeError, KeyError):
                        inv.fail(f"{path}:{i + 1}: not a record")
                n += len(steps)
                for a, b in zip(steps, steps[1:], strict=False):
                    if b > a + 1 and b in copied:
                        jumps += 1
                    elif b != a + 1:
                        inv.fail(f"{path}: step {a} then {b}")
                        break
        inv.count = f"{n} records, {jumps} jumps to a copied step"

    def reference(self, soak, seconds: float) -> None:
        """The survivors' val loss against a fault-free group trained to the same step."""
        from tests import gossip_util as gu

        inv = self.add("survivors' val loss within 5% of a fault-free group at the same step")
        survivors = [s for s in soak.slots_at_end if list((s.run / "checkpoints").glob("step_*"))]
        if not survivors:
            inv.fail("no survivor has a checkpoint")
            return
        from atom.checkpoint import list_checkpoints, step_of

        step = int(statistics.median(step_of(list_checkpoints(s.run)[-1]) for s in survivors))
        ref = soak.reference_group(step)
        ours = statistics.mean(gu.val_loss(s.run, soak.union) for s in survivors)
        theirs = statistics.mean(gu.val_loss(r, soak.union) for r in ref)
        self.figures.update(val_loss=ours, reference_val_loss=theirs, reference_step=step)
        inv.count = f"{ours:.4f} against {theirs:.4f} ({ours / theirs:.3f}x)"
        if ours > 1.05 * theirs:
            inv.fail(f"val loss {ours:.4f} > 1.05 x {theirs:.4f}")

    # ------------------------------------------------------------ the report
    def write(self, out: Path, args, faults, events) -> bool:
        ok = all(inv.ok for inv in self.invariants)
        kinds: dict[str, int] = {}
        for f in faults:
            if not f.detail.startswith("skipped"):
                kinds[f.kind] = kinds.get(f.kind, 0) + 1
        lines = [
            f"# Soak: {args.minutes:g} min, seed {args.seed}, {args.peers} peers",
            "",
            f"Command: `python -m tools.soak --minutes {args.minutes:g} --seed {args.seed} "
            f"--peers {args.peers} --each {args.each} --faults {args.faults}"
            + (" --reference" if args.reference else "")
            + "`",
            "",
            f"**{'All invariants held' if ok else 'Invariants failed'}.** Faults done: "
            + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none"),
            "",
            "| invariant | held | counts |",
            "|---|---|---|",
        ]
        lines += [f"| {i.name} | {'yes' if i.ok else '**no**'} | {i.count} |"
                  for i in self.invariants]  # fmt: skip
        for inv in self.invariants:
            if inv.problems:
                lines += ["", f"## {inv.name}", *[f"- {p}" for p in inv.problems]]
        lines += ["", "## Faults", "", "| at s | kind | held s | what |", "|---:|---|---:|---|"]
        lines += [f"| {f.at:.0f} | {f.kind} | {f.hold:.0f} | {f.detail} |" for f in faults]
        if events:
            lines += ["", "## Notes", *[f"- {e}" for e in events]]
        (out / "report.md").write_text("\n".join(lines) + "\n")
        summary = {
            "ok": ok, "minutes": args.minutes, "seed": args.seed, "peers": args.peers,
            "faults": [vars(f) for f in faults], "figures": self.figures,
            "invariants": [vars(i) for i in self.invariants], "notes": events,
        }  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return ok


def _runs(slot) -> list[Path]:
    return [slot.home / f"run{k}" for k in range(slot.runs + 1) if (slot.home / f"run{k}").is_dir()]


def _windows(faults) -> list[tuple[float, float]]:
    return [(f.at, f.ends + RECOVER_S) for f in faults if not f.detail.startswith("skipped")]


def check(soak, slots, seconds: float) -> Report:
    """The invariants that need the group still running (see the module's doc)."""
    report = Report()
    soak.slots_at_end = [s for s in slots if s.started and not s.gone]
    _training(report, soak, slots)
    _resources(report, slots)
    _logs(report, slots)
    _counters(report, soak.faults, slots)
    _partitions(report, soak.faults, slots)
    return report


def _training(report: Report, soak, slots) -> None:
    inv = report.add("every peer not gone for good is training at the end")
    live = soak.slots_at_end
    for s in live:
        since = max(soak.now() - 30.0, s.lives[-1].started)  # this process, this run dir
        recent = [n for t, n in s.steps if t >= since]
        if not s.up:
            inv.fail(f"s{s.index} is not running (exit {s.proc.returncode}; log {s.log})")
        elif len(recent) < 2 or recent[-1] <= recent[0]:
            inv.fail(f"s{s.index} made no step in the last 30 s")
    inv.count = f"{len(live)} peers"


def _growth(samples: list[float]) -> float:
    half = samples[len(samples) // 2 :]
    first, last = statistics.median(half[:3]), statistics.median(half[-3:])
    return (last - first) / max(first, 1e-9)


def _resources(report: Report, slots) -> None:
    inv = report.add(f"memory, files, threads flat over each process's second half "
                     f"(RSS growth < {RSS_GROWTH:.0%}; lives over {MIN_LIFE_S:.0f} s)")  # fmt: skip
    n, worst = 0, 0.0
    for s in slots:
        for life in s.lives:
            if len(life.samples) < 12 or life.samples[-1][0] - life.samples[0][0] < MIN_LIFE_S:
                continue
            n += 1
            rss = _growth([x[1] for x in life.samples])
            worst = max(worst, rss)
            fds = [x[2] for x in life.samples[len(life.samples) // 2 :]]
            thr = [x[3] for x in life.samples[len(life.samples) // 2 :]]
            if rss >= RSS_GROWTH:
                inv.fail(f"s{s.index} pid {life.pid}: RSS grew {rss:.1%}")
            # a connection is a file: up to 2 for every peer it may know, in and out
            if statistics.median(fds[-3:]) > statistics.median(fds[:3]) + 8 + 2 * len(slots):
                inv.fail(f"s{s.index} pid {life.pid}: open files {fds[0]} -> {fds[-1]}")
            if statistics.median(thr[-3:]) > statistics.median(thr[:3]) + 2:
                inv.fail(f"s{s.index} pid {life.pid}: threads {thr[0]} -> {thr[-1]}")
    inv.count = f"{n} processes; worst RSS growth {worst:.1%}"


def _logs(report: Report, slots) -> None:
    inv = report.add("no traceback in any log (every error is one line)")
    n = errors = 0
    for s in slots:
        for log in sorted(s.home.parent.glob(f"{s.home.name}-*.log")):
            n += 1
            text = log.read_text(errors="replace")
            errors += text.count("atom: error:")
            if "Traceback (most recent call last)" in text:
                at = text.index("Traceback")
                inv.fail(f"{log.name}: {text[at : at + 300]!r}")
    inv.count = f"{n} logs, {errors} one-line errors"


def _counters(report: Report, faults, slots) -> None:
    inv = report.add("no guard firing or refusal between honest peers outside fault windows")
    windows = _windows(faults)
    inside = outside = 0
    for s in slots:
        for (t0, a), (t1, b) in zip(s.counters, s.counters[1:], strict=False):
            for key, value in b.items():
                if not key.startswith(WATCHED):
                    continue
                grew = value - a.get(key, 0)
                if grew <= 0:
                    continue  # (a restart starts the counters again)
                if any(lo <= t1 and t0 <= hi for lo, hi in windows):
                    inside += grew
                else:
                    outside += grew
                    inv.fail(f"s{s.index} at {t1:.0f} s: {key} +{grew:g}")
    inv.count = f"{outside:g} outside, {inside:g} inside fault windows"


def _partitions(report: Report, faults, slots) -> None:
    parts = [f for f in faults if f.kind == "partition" and not f.detail.startswith("skipped")]
    inv = report.add(f"after a partition heals, the halves exchange again within {HEAL_S:.0f} s")
    took = []
    for f in parts:
        halves = [
            [int(x[1:]) for x in side.strip("{} ").split(",") if x] for side in f.detail.split("|")
        ]
        ids = [{f"s{i}" for i in h} for h in halves]
        for side, other in ((halves[0], ids[1]), (halves[1], ids[0])):
            for i in side:
                rows = slots[i].rows
                before = [r for t, r in rows if t <= f.ends]
                after = [(t, r) for t, r in rows if f.ends < t <= f.ends + HEAL_S]
                base = sum(before[-1].get(p, 0) for p in other) if before else 0
                when = next((t for t, r in after if sum(r.get(p, 0) for p in other) > base), None)
                if when is None:
                    inv.fail(f"partition at {f.at:.0f} s: s{i} made no exchange across")
                else:
                    took.append(when - f.ends)
    inv.count = f"{len(parts)} partitions" + (f"; slowest {max(took):.0f} s" if took else "")
