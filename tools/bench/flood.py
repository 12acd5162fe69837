"""A half-open connection flood against a training peer, measured.

    python -m tools.bench.flood [--connections 3000] [--steps 400] [--repeats 3]
    python -m tools.bench.flood --peers 3 [--steps 300] [--repeats 3] [--sources 127.0.0.2]
    python -m tools.bench.flood flood tcp://127.0.0.1:PORT [-n 3000] [--sources 127.0.0.2]

bench (the default): one training peer (`atom train`, gossip listening), each run alone
or under a flood of `--connections` TCP connections that never send a byte of the ZeroMQ
greeting, each one the peer drops opened again at once (a flooder does that). Runs are
interleaved (none, flood, none, flood, ...) and repeated; each peer is its own process.
It prints the peer's median step time for each run, the peer's most open files, its CPU
seconds per step, and a markdown row.

--peers 3: a group of three (tests/adversary.py honest_group: disjoint shards, each peer
its own process, the first one the seed), the first one flooded once all three passed
step 20, from --sources (by default 127.0.0.2: the honest peers use 127.0.0.1, and the
flood's address is the one refused past the cap, so the flooder stands for another
machine). For the victim and the two others: the median step time against the clean runs'
(flooded/clean), the most open files, and the exchanges each served.

flood: the flooder alone, until SIGINT or SIGTERM; its last line is a JSON summary
(connections opened, the most held at once, the longest any one lived). It runs at the
lowest CPU priority (SCHED_IDLE): on this one machine it stands for an attacker on
another, so what it costs the peer is what the peer does, not the flooder's own loop.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GREETING_START = b"\xff" + b"\x00" * 8 + b"\x7f"  # ZMTP's signature: then nothing more


class HalfOpenFlood:
    """`n` TCP connections to host:port that send `send` (by default nothing) and then
    wait; each one closed by the server is opened again at once, from the next of
    `sources` (local addresses: 127.0.0.2 and up are loopback too, so a test can flood
    from addresses its honest peers do not use)."""

    def __init__(self, host: str, port: int, n: int, sources: list[str] | None = None,
                 send: bytes = b""):  # fmt: skip
        self.addr, self.n, self.send = (host, port), n, send
        self.sources = sources or [""]
        self.opened = self.failed = self.most = self.accepted = 0
        # seconds, the longest any connection stayed open once the server accepted it (its
        # greeting came): one it never accepted waits in the client's kernel, costing it
        # nothing
        self.longest = 0.0
        self._open: set[socket.socket] = set()
        self._accepted: dict[socket.socket, float] = {}  # -> when the greeting came
        self._sel = selectors.DefaultSelector()
        self._next_source = 0

    def _connect(self) -> bool:
        sk = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sk.setblocking(False)
        try:
            source = self.sources[self._next_source % len(self.sources)]
            self._next_source += 1
            if source:
                sk.bind((source, 0))
            err = sk.connect_ex(self.addr)
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, os.strerror(err))
        except OSError:
            sk.close()
            self.failed += 1
            return False
        self._open.add(sk)
        self._sel.register(sk, selectors.EVENT_READ | selectors.EVENT_WRITE if self.send
                           else selectors.EVENT_READ)  # fmt: skip
        self.opened += 1
        return True

    def _drop(self, sk: socket.socket) -> None:
        self._open.discard(sk)
        since = self._accepted.pop(sk, None)
        if since is not None:
            self.longest = max(self.longest, time.monotonic() - since)
        self._sel.unregister(sk)
        sk.close()

    def run(self, stop: threading.Event, every_s: float = 0.01) -> None:
        try:
            while not stop.is_set():
                for _ in range(self.n - len(self._open)):
                    if not self._connect():
                        break  # refused (a listener being reopened): again in a moment
                self.most = max(self.most, len(self._open))
                for key, mask in self._sel.select(every_s):
                    sk = key.fileobj
                    if mask & selectors.EVENT_WRITE:  # connected: send the start, once
                        with contextlib.suppress(OSError):
                            sk.send(self.send)
                        self._sel.modify(sk, selectors.EVENT_READ)
                        continue
                    try:  # the server's greeting, an end, or an error
                        gone = sk.recv(4096) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    if gone:
                        self._drop(sk)
                    elif sk not in self._accepted:
                        self._accepted[sk] = time.monotonic()
                        self.accepted += 1
        finally:
            for sk in list(self._open):
                self._drop(sk)

    def summary(self) -> dict:
        return {"opened": self.opened, "failed": self.failed, "accepted": self.accepted,
                "most_held": self.most, "longest_s": round(self.longest, 2)}  # fmt: skip


@contextlib.contextmanager
def flooding(endpoint: str, n: int, sources: list[str] | None = None,
             send: bytes = b"", *flags: str) -> Iterator[dict]:  # fmt: skip
    """A flooder process (`flood`) against `endpoint` for the block; the dict it yields
    gets its summary when the block ends."""
    cmd = [sys.executable, "-m", "tools.bench.flood", "flood", endpoint, "-n", str(n), *flags]
    if sources:
        cmd += ["--sources", ",".join(sources)]
    if send:
        cmd += ["--send-hex", send.hex()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    result: dict = {}
    try:
        yield result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        lines = out.strip().splitlines()
        if lines:
            result.update(json.loads(lines[-1]))


def cmd_flood(args: argparse.Namespace) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if not args.normal_priority:
        with contextlib.suppress(AttributeError, OSError):  # the lowest priority there is
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host, port = args.endpoint.removeprefix("tcp://").rsplit(":", 1)
    sources = args.sources.split(",") if args.sources else None
    flood = HalfOpenFlood(host, int(port), args.n, sources, bytes.fromhex(args.send_hex))
    flood.run(stop)
    print(json.dumps(flood.summary()), flush=True)


# ------------------------------------------------------------------ bench
def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_once(work: Path, data: Path, steps: int, flood: int) -> dict:
    import psutil

    from tests import gossip_util as gu
    from tools.bench.attacks import STEPS_MODEL

    run = work / f"victim_{'flood' if flood else 'none'}"
    args = gu.peer_cmd(run, data, steps, 1, "--listen", "tcp://127.0.0.1:0", *STEPS_MODEL)
    proc = gu.start(args, work / f"{run.name}.log")
    files = cpu0 = cpu1 = 0.0
    step0 = step1 = 0
    summary: dict = {}
    try:
        endpoint = gu.endpoint(run, 120, [proc])
        gu.wait_for(lambda: gu.last_step(run) >= 20, 120, "the first steps", [proc])
        child = psutil.Process(proc.pid)
        cpu0, step0 = _cpu_s(proc.pid), gu.last_step(run)
        with flooding(endpoint, flood) if flood else contextlib.nullcontext({}) as summary:
            while proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    files = max(files, child.num_fds())
                    cpu1, step1 = _cpu_s(proc.pid), gu.last_step(run)
                time.sleep(0.05)
    finally:
        gu.stop_all([proc], timeout=120)
    step, _, counted = gu.step_figures(run, ("gate", "guard", "auth"))
    return {"flood": flood, "code": proc.returncode, "step_s": step, "most_files": int(files),
            "cpu_per_step_ms": 1000 * (cpu1 - cpu0) / max(1, step1 - step0),
            "flooder": summary, "counters": counted}  # fmt: skip


def run_group(work: Path, steps: int, flood: int, sources: list[str]) -> dict:
    """Three peers, the first flooded from step 20 on (with `flood`): each one's median
    step, most open files and exchanges served."""
    import psutil

    from tests import gossip_util as gu
    from tests.adversary import honest_group
    from tools.bench.attacks import STEPS_MODEL

    root = work / f"group_{'flood' if flood else 'none'}"
    root.mkdir()
    out: dict = {}

    def during(procs, runs) -> None:
        gu.wait_for(lambda: all(gu.last_step(r) >= 20 for r in runs), 180, "step 20", procs)
        children = [psutil.Process(p.pid) for p in procs]
        files = [0] * len(procs)
        victim = gu.status(runs[0])["endpoint"]
        with flooding(victim, flood, sources) if flood else contextlib.nullcontext({}) as got:
            while any(p.poll() is None for p in procs):
                for k, child in enumerate(children):
                    with contextlib.suppress(psutil.Error):
                        files[k] = max(files[k], child.num_fds())
                time.sleep(0.05)
        out.update(most_files=files, flooder=got)

    result = honest_group(root, steps, None, tuple(STEPS_MODEL), during=during)
    figures = [gu.step_figures(root / f"h{k}", ("gate", "guard", "auth", "served.ok"))
               for k in range(3)]  # fmt: skip
    return {"flood": flood, "codes": result["codes"], "step_s": [f[0] for f in figures],
            "served": [int(f[2].get("served.ok", 0)) for f in figures],
            "val_loss": result["val_loss"], "counters": figures[0][2], **out}  # fmt: skip


def cmd_group(args: argparse.Namespace) -> None:
    sources = (args.sources or "127.0.0.2").split(",")
    rows: dict[int, list[dict]] = {0: [], args.connections: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for flood in rows:  # interleaved: each flooded group beside a clean one
                sub = Path(tmp) / f"r{r}"
                sub.mkdir(exist_ok=True)
                result = run_group(sub, args.steps or 300, flood, sources)
                rows[flood].append(result)
                print(json.dumps(result), flush=True)
    victim = lambda x: x["step_s"][0]  # noqa: E731
    others = lambda x: statistics.median(x["step_s"][1:])  # noqa: E731
    base_v = statistics.median(victim(x) for x in rows[0])
    base_o = statistics.median(others(x) for x in rows[0])
    print("\n| half-open connections | victim's median step, ms (runs) | vs none | others', ms "
          "(runs) | vs none | most open files: victim, others | served: victim, others "
          "(each run) | exit |")  # fmt: skip
    print("|---|---|---:|---|---:|---|---|---|")
    for flood, results in rows.items():
        v, o = [victim(x) for x in results], [others(x) for x in results]
        files = [x["most_files"] for x in results]
        served = "; ".join(", ".join(str(n) for n in x["served"]) for x in results)
        print(f"| {flood} | {1000 * statistics.median(v):.1f} "
              f"({', '.join(f'{1000 * s:.1f}' for s in v)}) "
              f"| {statistics.median(v) / base_v:.2f}x "
              f"| {1000 * statistics.median(o):.1f} ({', '.join(f'{1000 * s:.1f}' for s in o)}) "
              f"| {statistics.median(o) / base_o:.2f}x "
              f"| {max(f[0] for f in files)}, {max(max(f[1:]) for f in files)} | {served} "
              f"| {[x['codes'] for x in results]} |")  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> None:
    from tests import gossip_util as gu

    if args.peers == 3:
        cmd_group(args)
        return
    if args.peers != 1:
        sys.exit("--peers: 1 (one peer alone) or 3 (a group, the first one flooded)")
    rows: dict[int, list[dict]] = {0: [], args.connections: []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shards, _ = gu.make_shards(work)
        for r in range(args.repeats):
            for flood in rows:
                sub = work / f"r{r}"
                sub.mkdir(exist_ok=True)
                result = run_once(sub, shards[0], args.steps or 400, flood)
                rows[flood].append(result)
                print(json.dumps(result), flush=True)
    base = statistics.median(x["step_s"] for x in rows[0])
    print("\n| half-open connections | median step (ms) | vs none | most open files "
          "| CPU per step (ms) | exit |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for flood, results in rows.items():
        steps = [x["step_s"] for x in results]
        cpu = [x["cpu_per_step_ms"] for x in results]
        print(f"| {flood} | {1000 * statistics.median(steps):.1f} "
              f"({', '.join(f'{1000 * s:.1f}' for s in steps)}) "
              f"| {statistics.median(steps) / base:.2f}x "
              f"| {max(x['most_files'] for x in results)} "
              f"| {statistics.median(cpu):.1f} ({', '.join(f'{c:.1f}' for c in cpu)}) "
              f"| {[x['code'] for x in results]} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=0, help="default 400; 300 with --peers 3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", type=int, default=1, help="1, or 3: a group, one flooded")
    parser.add_argument("--sources", default="", help="with --peers 3: the flood's addresses")
    p = sub.add_parser("flood", help="the flooder alone (a child of the bench and tests)")
    p.add_argument("endpoint", help="tcp://HOST:PORT")
    p.add_argument("-n", type=int, default=3000, help="connections held at once")
    p.add_argument("--sources", default="", help="local addresses to connect from, a,b,...")
    p.add_argument("--send-hex", default="", help="bytes each connection sends, then stops")
    p.add_argument(
        "--normal-priority",
        action="store_true",
        help="compete for the CPU like any process (default: SCHED_IDLE)",
    )
    args = parser.parse_args()
    if args.command == "flood":
        cmd_flood(args)
    else:
        cmd_bench(args)


if __name__ == "__main__":
    main()
