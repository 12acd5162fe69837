"""The soak's invariants (tools/net/soak.py), each a line in the report with its counts.

Checked while the group still runs (check): every peer not gone for good is up and
training; its resident memory, open files and threads flat over the second half of each
process's life after a minute of warm-up; no traceback in any log; no memory-guard
firing, rate-limit refusal or other refusal between the peers outside the faults' own
windows (a fault's window ends RECOVER_S after it does); after each partition heals,
every peer exchanges again with the other half, and the group comes back as close as it
was (the largest distance between two peers' models at their latest exchange) within
CONSENSUS_STEPS. After every peer was stopped (after_stop): each run directory's newest
checkpoint loads (sha256 verified) and holds no weight that is not finite or beyond
1e6; metrics.jsonl has one record per step, no gaps or repeats; each survivor's newest
checkpoint resumes exactly. With --reference: the survivors' val loss within 5% of a
fault-free group's, trained beside them for as long.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tools.net.soak_faults import RECOVER_S

RSS_GROWTH = 0.05
WARM_S = 60.0  # a process's start (joining, first allocations) is not a leak
MIN_LIFE_S = 60.0  # after warm-up: shorter lives say nothing about leaks
HEAL_S = 30.0  # a partition healed: both halves exchange again within this
CLOSE_FACTOR = 2.0  # ... and are as close as before (max pairwise distance) within
# ... within this many steps of each peer (plain averaging: each step an outer step); about
# 35 s at the soak's ~14 steps/s. Set after the first hour-long run measured it: 200 was
# a guess, and one of 5 partitions (50 s apart, 10 peers on 2 cores) took 281 steps
CONSENSUS_STEPS = 500
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
        self._resumes(soak)

    def _checkpoints(self, slots) -> None:
        import torch

        from atom.store.checkpoint import list_checkpoints, load_checkpoint

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

    def _resumes(self, soak) -> None:
        """Each survivor's newest checkpoint resumed alone (gossip off): two steps in one
        process and one step, a save and a second resume must reach the same loss, as
        tests/test_train_resume.py asks of a run that never met a fault."""
        from atom.store.checkpoint import list_checkpoints, step_of

        inv = self.add("each survivor's newest checkpoint resumes exactly (2 steps in one "
                       "process = 1 step, saved, resumed, 1 step)")  # fmt: skip
        n = 0
        for s in soak.slots_at_end:
            ckpts = list_checkpoints(s.run)
            if not ckpts:
                continue
            n += 1
            ckpt, step = ckpts[-1], step_of(ckpts[-1])
            home = soak.out / "resume" / f"s{s.index}"
            try:
                _solo(ckpt, home / "once", step + 2, soak.out)
                _solo(ckpt, home / "twice", step + 1, soak.out)
                _solo(home / "twice", None, step + 2, soak.out)
                once, twice = _loss_at(home / "once", step + 2), _loss_at(home / "twice", step + 2)
            except (RuntimeError, OSError, KeyError, json.JSONDecodeError) as err:
                inv.fail(f"s{s.index} {ckpt}: {err}")
                continue
            if once != twice:
                inv.fail(f"s{s.index} {ckpt}: loss {once!r} in one process, {twice!r} resumed")
        inv.count = f"{n} checkpoints"

    def reference(self, soak, reference) -> None:
        """The survivors' val loss against the fault-free group trained beside them."""
        from atom.store.checkpoint import list_checkpoints, step_of
        from tests import gossip_util as gu

        inv = self.add("survivors' val loss within 5% of a fault-free group trained as long")
        ours = [s.run for s in soak.slots_at_end if list_checkpoints(s.run)]
        theirs = [s.run for s in reference if list_checkpoints(s.run)]
        if not ours or not theirs:
            inv.fail(f"checkpoints: {len(ours)} survivors, {len(theirs)} reference peers")
            return
        loss = statistics.mean(gu.val_loss(run, soak.union) for run in ours)
        ref = statistics.mean(gu.val_loss(run, soak.union) for run in theirs)
        step = statistics.median(step_of(list_checkpoints(run)[-1]) for run in ours)
        ref_step = statistics.median(step_of(list_checkpoints(run)[-1]) for run in theirs)
        self.figures.update(val_loss=loss, reference_val_loss=ref, median_step=step,
                            reference_median_step=ref_step)  # fmt: skip
        inv.count = (f"{loss:.4f} against {ref:.4f} ({loss / ref:.3f}x; median step "
                     f"{step:.0f} against {ref_step:.0f})")  # fmt: skip
        if loss > 1.05 * ref:
            inv.fail(f"val loss {loss:.4f} > 1.05 x {ref:.4f}")

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
            f"Command: `python -m tools.net.soak --minutes {args.minutes:g} --seed {args.seed} "
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


def _solo(resume: Path, out: Path | None, max_steps: int, cwd: Path) -> None:
    """`atom train --resume` alone, gossip off (its addresses are gone with the soak's)."""
    import subprocess
    import sys

    from tools import tool_env

    argv = [sys.executable, "-m", "atom.cli", "train", "--resume", str(resume),
            "--max-steps", str(max_steps), "--set", "gossip.listen=null",
            "--set", 'gossip.join=""', "--set", "gossip.group_key=null"]  # fmt: skip
    if out is not None:
        argv += ["--out", str(out)]
    env = tool_env({"OMP_NUM_THREADS": "1"})
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"resume exited {r.returncode}: {last}")


def _loss_at(run: Path, step: int) -> float:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step:
            return record["loss"]
    raise KeyError(f"{run}: no record of step {step}")


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
        if not s.up:
            inv.fail(f"s{s.index} is not running (exit {s.proc.returncode}; log {s.log})")
        elif not soak.training_now(s):
            inv.fail(f"s{s.index} made no step in the last 30 s")
    inv.count = f"{len(live)} peers"


def _growth(samples: list[float]) -> float:
    half = samples[len(samples) // 2 :]
    first, last = statistics.median(half[:3]), statistics.median(half[-3:])
    return (last - first) / max(first, 1e-9)


def _resources(report: Report, slots) -> None:
    inv = report.add(f"memory, files, threads flat over each process's second half after "
                     f"{WARM_S:.0f} s of warm-up (RSS growth < {RSS_GROWTH:.0%}; lives of "
                     f"{WARM_S + MIN_LIFE_S:.0f} s or more)")  # fmt: skip
    n, worst = 0, 0.0
    for s in slots:
        for life in s.lives:
            samples = [x for x in life.samples if x[0] >= life.started + WARM_S]
            if len(samples) < 12 or samples[-1][0] - samples[0][0] < MIN_LIFE_S:
                continue
            n += 1
            rss = _growth([x[1] for x in samples])
            worst = max(worst, rss)
            fds = [x[2] for x in samples[len(samples) // 2 :]]
            thr = [x[3] for x in samples[len(samples) // 2 :]]
            if rss >= RSS_GROWTH:
                inv.fail(f"s{s.index} pid {life.pid}: RSS grew {rss:.1%}")
            # a connection is a file: up to 4 for every peer it may know (two lanes and the
            # heartbeat dial it, it dials us)
            if statistics.median(fds[-3:]) > statistics.median(fds[:3]) + 8 + 4 * len(slots):
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
    mixed = report.add(f"after a partition heals, the halves exchange again within {HEAL_S:.0f} s")
    close = report.add(f"after a partition heals, the group is as close as before it (max "
                       f"pairwise apart within {CLOSE_FACTOR:g}x) within {CONSENSUS_STEPS} "
                       "steps")  # fmt: skip
    took, steps = [], []
    for f in parts:
        halves = [
            [int(x[1:]) for x in side.strip("{} ").split(",") if x] for side in f.detail.split("|")
        ]
        ids = [{f"s{i}" for i in h} for h in halves]
        members = [(i, ids[1]) for i in halves[0]] + [(i, ids[0]) for i in halves[1]]
        for i, other in members:
            rows = slots[i].rows
            before = [r for t, r in rows if t <= f.ends]
            after = [(t, r) for t, r in rows if f.ends < t <= f.ends + HEAL_S]
            base = _crossed(before[-1], other) if before else 0
            when = next((t for t, r in after if _crossed(r, other) > base), None)
            if when is None:
                mixed.fail(f"partition at {f.at:.0f} s: s{i} made no exchange across")
            else:
                took.append(when - f.ends)
        # the group's spread as the partition began: the largest distance any peer saw
        # at its latest exchange with anyone
        spread = max((a for i, _ in members for a in _aparts(slots[i].rows, f.at)), default=None)
        if not spread:
            continue  # nobody had exchanged yet: nothing to come back to
        at_heal = {i: _step_at(slots[i], f.ends) for i, _ in members}
        rows_after = {i: [(t, r) for t, r in slots[i].rows if t > f.ends] for i, _ in members}
        back = None
        for t in sorted({t for rs in rows_after.values() for t, _ in rs}):
            if _close_at(slots, members, f.ends, t, spread):
                back = t
                break
        if back is None:
            close.fail(f"partition at {f.at:.0f} s: never within {CLOSE_FACTOR:g}x of {spread:.2e}")
            continue
        took_steps = max(_step_at(slots[i], back) - at_heal[i] for i, _ in members)
        steps.append(took_steps)
        if took_steps > CONSENSUS_STEPS:
            close.fail(f"partition at {f.at:.0f} s: {took_steps} steps to come back")
    mixed.count = f"{len(parts)} partitions" + (f"; slowest {max(took):.0f} s" if took else "")
    close.count = f"{len(steps)} partitions measured" + (
        f"; slowest {max(steps)} steps" if steps else ""
    )


def _crossed(row: dict, other: set[str]) -> int:
    return sum(row.get(p, (0, None))[0] for p in other)


def _aparts(rows, t: float) -> list[float]:
    """The distances a peer reported at its last sample up to t."""
    last = [r for u, r in rows if u <= t]
    return [a for _, a in last[-1].values() if a is not None] if last else []


def _step_at(slot, t: float) -> int:
    return max((n for u, n in slot.steps if u <= t), default=0)


def _close_at(slots, members, healed: float, t: float, spread: float) -> bool:
    """At sample time t every member has exchanged across since the heal, and every pair
    that exchanged since is within CLOSE_FACTOR of the spread before the partition."""
    for i, other in members:
        rows = slots[i].rows
        at_heal = [r for u, r in rows if u <= healed]
        now = [r for u, r in rows if u <= t]
        if not now:
            return False
        base, row = (at_heal[-1] if at_heal else {}), now[-1]
        if _crossed(row, other) <= _crossed(base, other):
            return False
        for pid, (n, apart) in row.items():
            fresh = n > base.get(pid, (0, None))[0]
            if fresh and apart is not None and apart > CLOSE_FACTOR * spread:
                return False
    return True
