"""A group that trains for minutes or hours through crashes, partitions, full disks and
restarts, checked against invariants (Jepsen-style nemesis runs, for a gossip group).

    python -m tools.net.soak --minutes 2                  # one fault of each kind that fits
    python -m tools.net.soak --minutes 60 --seed 7 --each 5 --out soak-7
    python -m tools.net.soak --minutes 20 --seed 8 --reference   # + a fault-free group beside it
    python -m tools.net.soak --minutes 10 --peers 3 --faults none  # a healthy group: no firings

N peers (default 5; tiny model, CPU), each `atom train` in a process of its own: in a
network namespace of its own on a bridge (tools/net/shape.py) when this process may make
them (root), else on loopback, where the network faults are left out. A seeded schedule
of faults (tools/net/soak_faults.py: kills and restarts, clean stops, pauses, full disks,
partitions, slow and flapping links, late joiners, peers leaving) runs one at a time;
`--seed` replays it. A live line shows elapsed time, faults so far, peers up and the
group's steps/s. At the end every peer is stopped with Ctrl+C and the invariants are
checked (tools/net/soak_checks.py); report.md and summary.json go to --out. Exit 0 when all
hold, 1 when one does not (the report says which, with its counts).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from tests import gossip_util as gu  # noqa: E402
from tools import tool_env  # noqa: E402
from tools.net.soak_faults import KINDS, Fault, schedule, usable_kinds  # noqa: E402

PORT = 5555
DISK_MB = 48  # each peer's run directory, a tmpfs when root: small enough to fill at once
CKPT_EVERY = 10  # steps: saves often, so that kills land mid-save too
SLOW_LINK_LOSS = 2.0  # percent of a slowed link's frames dropped, each way (issue 28)
WARMUP_S = 20.0
START_GRACE_S = 120.0  # at the end: for a peer just restarted to make its first steps


@dataclass
class Life:
    """One process of a slot: from start to exit, with its samples."""

    pid: int
    run: Path
    started: float
    ended: float | None = None
    code: int | None = None
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)  # t, rss, fds, thr


@dataclass
class Slot:
    """A peer's place: its namespace, address and run directory across restarts."""

    index: int
    home: Path  # holds its run directories (a tmpfs when root)
    port: int = PORT
    reference: bool = False  # of the fault-free group (--reference): loopback, its own keys
    runs: int = 0  # run directories made (a fresh join makes a new one)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    gone: bool = False  # left for good
    started: bool = False
    lives: list[Life] = field(default_factory=list)
    counters: list[tuple[float, dict]] = field(default_factory=list)  # (t, gossip counters)
    steps: list[tuple[float, int]] = field(default_factory=list)
    # (t, {peer id: (exchanges with it, how far apart at the last one)})
    rows: list[tuple[float, dict]] = field(default_factory=list)

    @property
    def run(self) -> Path:
        return self.home / f"run{self.runs}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Soak:
    def __init__(self, args: argparse.Namespace, out: Path):
        self.args, self.out = args, out
        self.t0 = 0.0
        self.net = None
        self.keys: Path | None = None
        self.mounts: list[Path] = []
        self.root = os.geteuid() == 0
        self.faults: list[Fault] = []
        self.events: list[str] = []
        self.stop_flap = threading.Event()

    # ------------------------------------------------------------ setup
    def now(self) -> float:
        return time.monotonic() - self.t0

    def ip(self, i: int) -> str:
        return self.net.ip(i) if self.net is not None else "127.0.0.1"

    def endpoint(self, s: Slot) -> str:
        return f"tcp://{'127.0.0.1' if s.reference else self.ip(s.index)}:{s.port}"

    def set_up(self, n_slots: int) -> list[Slot]:
        from tools.net import shape as netshape

        (self.out / "data").mkdir(parents=True, exist_ok=True)
        # every peer trains on the union of three vocabularies, each in its own order: with
        # a shard each, a peer's val loss swung 0.75-3.2 inside one fault-free group (its
        # own vocabulary pushed up between exchanges), too much for a 5% comparison
        _, self.union = gu.make_shards(self.out / "data", n_lines=1500)
        why = netshape.available() if not self.args.loopback else "--loopback"
        if why is None:
            self.net = netshape.NetShape(n_slots, tag="soak")
            self.net.__enter__()
        else:
            self.events.append(f"no network namespaces ({why}): loopback, network faults left out")
        from atom.gossip.net.keys import keygen

        self.keys = self.out / "keys"
        keygen(self.keys, [f"s{i}" for i in range(n_slots)])
        slots = []
        for i in range(n_slots):
            home = self.out / f"slot{i}"
            home.mkdir(parents=True)
            if self.root and not self.args.no_tmpfs:
                r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs",
                                    str(home)], capture_output=True, text=True)  # fmt: skip
                if r.returncode == 0:
                    self.mounts.append(home)
            slots.append(Slot(i, home, port=PORT if self.net is not None else _free_port()))
        return slots

    def tear_down(self) -> None:
        self.stop_flap.set()
        for home in self.mounts:
            # the run directories are checked by now; keep a copy beside the report
            dest = home.parent / f"{home.name}-kept"
            shutil.copytree(home, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("fill"))
            subprocess.run(["umount", "-l", str(home)], capture_output=True)
        if self.net is not None:
            self.net.__exit__(None, None, None)

    # ------------------------------------------------------------ peers
    def start(self, s: Slot, how: str, seeds: list[Slot], max_steps: int = 10**7) -> None:
        """how: first | join | resume | fresh."""
        if how == "fresh":
            s.runs += 1
        s.log = s.home.parent / f"{s.home.name}-{len(s.lives)}.log"
        argv = [sys.executable, "-m", "atom.cli", "train"]
        if how == "resume":
            argv += ["--resume", str(s.run)]
        else:
            argv += ["--out", str(s.run)]
        argv += ["--max-steps", str(max_steps),
                 "--set", f"train.data={self.union}",
                 "--set", f"train.seed={s.index + 1}", *gu.PEER_ARGS,
                 "--set", f"train.ckpt_interval={CKPT_EVERY}",
                 "--set", "train.keep_checkpoints=2", "--listen", self.endpoint(s),
                 "--group-key", str(self.key(s))]  # fmt: skip
        for other in seeds:
            argv += ["--join", self.endpoint(other)]
        env = tool_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        with open(s.log, "w") as f:
            kw = dict(stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(self.out))
            if self.net is not None and not s.reference:
                s.proc = self.net.popen(s.index, argv, **kw)
            else:
                s.proc = subprocess.Popen(argv, preexec_fn=gu._default_sigint, **kw)
        s.started = True
        s.lives.append(Life(s.proc.pid, s.run, self.now()))

    def key(self, s: Slot) -> Path:
        """Its group key: the reference group has keys of its own, so that the two groups
        could not mix even if one dialled the other."""
        return (self.keys.parent / "reference-keys" if s.reference else self.keys) / f"s{s.index}"

    def training_now(self, s: Slot) -> bool:
        """Up, and its steps went on over the last 30 s of its current process."""
        since = max(self.now() - 30.0, s.lives[-1].started)
        recent = [n for t, n in s.steps if t >= since]
        return s.up and len(recent) >= 2 and recent[-1] > recent[0]

    def reap(self, s: Slot) -> None:
        if s.proc is not None and s.proc.poll() is not None and s.lives[-1].ended is None:
            s.lives[-1].ended, s.lives[-1].code = self.now(), s.proc.returncode

    def signal(self, s: Slot, sig: int, wait_s: float = 0.0) -> None:
        if s.up:
            s.proc.send_signal(sig)
            if wait_s:
                try:
                    s.proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait(10)
        self.reap(s)

    # ------------------------------------------------------------ sampling
    def sample(self, slots: list[Slot]) -> None:
        t = self.now()
        for s in slots:
            self.reap(s)
            if not s.up:
                continue
            try:
                p = psutil.Process(s.proc.pid)
                s.lives[-1].samples.append((t, p.memory_info().rss, p.num_fds(), p.num_threads()))
            except (psutil.Error, OSError):
                pass
            st = gu.status(s.run)
            if st.get("counters") is not None:
                s.counters.append((t, st["counters"]))
                s.rows.append(
                    (t, {r["id"]: (r["exchanges"], r.get("apart")) for r in st.get("peers", [])})
                )
            s.steps.append((t, gu.last_step(s.run)))

    # ------------------------------------------------------------ faults
    def begin(self, f: Fault, slots: list[Slot], rng) -> None:
        """Do fault f (its target chosen among the peers up now); f.detail says what."""
        up = [s for s in slots if s.up and not s.gone]
        if f.kind == "late_join":
            new = [s for s in slots if not s.started]
            if not new or not up:
                f.detail = "skipped: no slot left" if not new else "skipped: nobody up"
                return
            f.target = new[0].index
            self.start(new[0], "join", rng.sample(up, min(2, len(up))))
            f.detail = f"s{f.target} joins"
            return
        floor = 3 if f.kind in ("leave", "partition") else 2
        if len(up) < floor:
            f.detail = f"skipped: {len(up)} peers up"
            return
        if f.kind == "partition":
            rng.shuffle(up)
            half = len(up) // 2
            self.halves = (up[:half], up[half:])
            self._partition(True)
            f.detail = "{" + ",".join(f"s{x.index}" for x in self.halves[0]) + "} | {" + ",".join(
                f"s{x.index}" for x in self.halves[1]) + "}"  # fmt: skip
            return
        target = rng.choice(up)
        f.target = target.index
        f.detail = f"s{target.index}"
        if f.kind.startswith("kill_"):
            if self._mid_save(target, rng):
                f.detail += " mid-save"
            self.signal(target, signal.SIGKILL, wait_s=10)
        elif f.kind in ("term_restart", "leave"):
            sig = signal.SIGTERM if f.kind == "term_restart" else signal.SIGINT
            self.signal(target, sig, wait_s=60)
            f.detail += f" exited {target.proc.returncode}"
            target.gone = f.kind == "leave"
        elif f.kind == "pause":
            target.proc.send_signal(signal.SIGSTOP)
        elif f.kind == "disk_full":
            if target.home not in self.mounts:
                f.detail = "skipped: no tmpfs"
                return
            _fill(target.home / "fill")
        elif f.kind == "slow_link":
            n = self.net.n
            rates = [[1.0 if target.index in (i, j) and i != j else 0.0 for j in range(n)]
                     for i in range(n)]  # fmt: skip
            self.net.set_rates(rates)
            if shutil.which("nft"):  # 2% of its frames lost too (no netem: no delay here)
                self.net.set_loss(target.index, SLOW_LINK_LOSS)
                f.detail += f" {SLOW_LINK_LOSS:g}% loss"
        elif f.kind == "flap":
            self.stop_flap.clear()
            threading.Thread(target=self._flap, args=(target.index,), daemon=True).start()

    def end(self, f: Fault, slots: list[Slot], rng) -> None:
        if f.detail.startswith("skipped") or f.kind in ("late_join", "leave"):
            return
        if f.kind == "partition":
            self._partition(False)
            return
        s = slots[f.target]
        up = [x for x in slots if x.up and x is not s and not x.gone]
        seeds = rng.sample(up, min(2, len(up)))
        if f.kind == "kill_move":
            s.port = s.port + 1 if self.net is not None else _free_port()
            self.start(s, "resume", seeds)
            f.detail += f" back at {self.endpoint(s)}"
        elif f.kind == "kill_fresh":
            self.start(s, "fresh", seeds)
        elif f.kind in ("kill_resume", "term_restart"):
            self.start(s, "resume", seeds)
        elif f.kind == "pause" and s.up:
            s.proc.send_signal(signal.SIGCONT)
        elif f.kind == "disk_full":
            (s.home / "fill").unlink(missing_ok=True)
        elif f.kind == "slow_link":
            self.net.set_rates(0.0)
            if self.net.losses.get(s.index):
                self.net.set_loss(s.index, 0.0)
        elif f.kind == "flap":
            self.stop_flap.set()

    def _mid_save(self, s: Slot, rng) -> bool:
        """Half the kills wait (up to 5 s) for a checkpoint being written, to land in it;
        True when one was seen being written."""
        if rng.random() < 0.5:
            return False
        deadline = time.monotonic() + 5.0
        ckpts = s.run / "checkpoints"
        while time.monotonic() < deadline and s.up:
            try:
                if any(p.name.startswith(".tmp-") for p in ckpts.iterdir()):
                    return True
            except OSError:  # not there yet, or the entry went while listing
                pass
            time.sleep(0.002)
        return False

    def _partition(self, on: bool) -> None:
        verb = "add" if on else "del"
        a, b = self.halves
        for x in a:
            for y in b:
                for src, dst in ((x, y), (y, x)):
                    subprocess.run(["ip", "-n", self.net.nodes[src.index], "route", verb,
                                    "blackhole", f"{self.ip(dst.index)}/32"],
                                   capture_output=True)  # fmt: skip

    def _flap(self, i: int) -> None:
        state = "down"
        while not self.stop_flap.is_set():
            subprocess.run(["ip", "-n", self.net.nodes[i], "link", "set", "eth0", state],
                           capture_output=True)  # fmt: skip
            state = "up" if state == "down" else "down"
            self.stop_flap.wait(1.0)
        subprocess.run(["ip", "-n", self.net.nodes[i], "link", "set", "eth0", "up"],
                       capture_output=True)  # fmt: skip

    def reference_group(self) -> list[Slot]:
        """The same group without faults, on loopback, trained beside the soak for as long
        (--reference): the survivors' val loss is compared with its."""
        from atom.gossip.net.keys import keygen

        home = self.out / "reference"
        slots = [Slot(i, home / f"slot{i}", port=_free_port(), reference=True)
                 for i in range(self.args.peers)]  # fmt: skip
        keygen(self.keys.parent / "reference-keys", [f"s{i}" for i in range(self.args.peers)])
        for s in slots:
            s.home.mkdir(parents=True)
        self.start(slots[0], "first", [])
        gu.endpoint(slots[0].run, 60, [slots[0].proc])
        for s in slots[1:]:
            self.start(s, "join", [slots[0]])
        return slots

    # ------------------------------------------------------------ the run
    def main(self) -> int:
        import random

        from tools.net import shape as netshape
        from tools.net import soak_checks

        args = self.args
        seconds = 60.0 * args.minutes
        netns = netshape.available() is None and not args.loopback
        kinds, left_out = usable_kinds(netns, self.root and not args.no_tmpfs)
        if args.faults != "all":
            asked = [] if args.faults == "none" else args.faults.split(",")
            unknown = sorted(set(asked) - set(KINDS))
            if unknown:
                raise SystemExit(f"soak: no fault kind {unknown}; kinds: {', '.join(KINDS)}")
            left_out += [f"{k}: not asked for (--faults)" for k in kinds if k not in asked]
            kinds = [k for k in kinds if k in asked]
        faults = schedule(args.seed, seconds, kinds, WARMUP_S, args.each) if kinds else []
        late = sum(f.kind == "late_join" for f in faults)
        slots = self.set_up(args.peers + late)
        self.events += left_out
        rng = random.Random(args.seed + 1)
        reference: list[Slot] = []
        try:
            self.t0 = time.monotonic()
            self.start(slots[0], "first", [])
            gu.endpoint(slots[0].run, 60, [slots[0].proc])
            for s in slots[1 : args.peers]:
                self.start(s, "join", [slots[0]])
            if args.reference:
                reference = self.reference_group()
            pending, active, shown = list(faults), [], 0.0
            while self.now() < seconds:
                t = self.now()
                while pending and pending[0].at <= t:
                    f = pending.pop(0)
                    self.begin(f, slots, rng)
                    active.append(f)
                    self.faults.append(f)
                for f in [f for f in active if f.ends <= t]:
                    self.end(f, slots, rng)
                    active.remove(f)
                self.sample(slots)
                if t - shown >= 5.0:
                    shown = t
                    print(self.live_line(slots, active, len(faults)), flush=True)
                time.sleep(1.0)
            for f in active:
                self.end(f, slots, rng)
            # a peer the last fault restarted may still be importing torch on a loaded box
            until = self.now() + START_GRACE_S
            while self.now() < until and not all(self.training_now(s) for s in slots
                                                 if s.started and not s.gone):  # fmt: skip
                self.sample(slots)
                time.sleep(1.0)
            self.sample(slots)
            report = soak_checks.check(self, slots, seconds)
            for s in slots + reference:  # Ctrl+C, as a user stops a peer; they save on the way out
                self.signal(s, signal.SIGINT, wait_s=60)
            report.after_stop(self, slots)
            if args.reference:
                report.reference(self, reference)
        finally:
            for s in slots + reference:
                if s.up:
                    s.proc.kill()
            self.tear_down()
        ok = report.write(self.out, args, self.faults, self.events)
        print(f"soak: {'all invariants held' if ok else 'INVARIANTS FAILED'}; report: "
              f"{self.out / 'report.md'}")  # fmt: skip
        return 0 if ok else 1

    def live_line(self, slots: list[Slot], active: list[Fault], total: int) -> str:
        up = sum(s.up for s in slots)
        rate = 0.0
        for s in slots:
            if not s.lives:
                continue
            # from 10 s into its process: a (re)joining peer's first records jump to the
            # group's step, which is not its speed
            since = max(self.now() - 10.0, s.lives[-1].started + 10.0)
            recent = [(t, n) for t, n in s.steps if t >= since]
            if len(recent) >= 2 and recent[-1][1] >= recent[0][1]:
                rate += (recent[-1][1] - recent[0][1]) / max(1e-9, recent[-1][0] - recent[0][0])
        now = ", ".join(f"{f.kind} {f.detail}" for f in active) or "-"
        m, sec = divmod(int(self.now()), 60)
        return (f"soak {m:02d}:{sec:02d} | faults {len(self.faults)}/{total} | peers up {up} | "
                f"{rate:.1f} steps/s | now: {now}")  # fmt: skip


def _fill(path: Path) -> None:
    """Write zeros until the disk is full (ENOSPC)."""
    chunk = bytes(1 << 20)
    try:
        with open(path, "wb") as f:
            while True:
                f.write(chunk)
                f.flush()
    except OSError:
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as sk:  # (another program may take it before the peer binds)
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1, help="the fault schedule (replayable)")
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--each", type=int, default=1, help="faults of every kind at least")
    ap.add_argument(
        "--faults", default="all", help="all, none (a healthy group), or kinds separated by commas"
    )
    ap.add_argument("--out", type=Path, default=None, help="default: a new temporary folder")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also run the group without faults beside it, as long, for the val-loss check",
    )
    ap.add_argument("--loopback", action="store_true", help="no namespaces even as root")
    ap.add_argument("--no-tmpfs", action="store_true", help="no tmpfs run directories")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="atom-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    return Soak(args, out).main()


if __name__ == "__main__":
    sys.exit(main())
