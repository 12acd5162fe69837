"""How much of this (shared) machine's CPU other users took while a benchmark ran.

Benchmarks here compare timings measured minutes apart on two cores that other sessions
also use; a measurement taken while someone else was busy is slower for reasons that
have nothing to do with what is measured. ForeignLoad puts a number on that: busy CPU
time from /proc/stat less what this process and its waited-for children used, as a
share of all cores over the wall time. Benchmarks record it next to every figure and
repeat measurements that were disturbed.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path

import psutil

log = logging.getLogger(__name__)


def _busy_s() -> float:
    """CPU seconds all cores have spent running processes since boot (/proc/stat: user,
    nice, system; not interrupts, whose time no process is charged for: our own network
    traffic would otherwise count as someone else's)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:4]]
    return sum(ticks) / os.sysconf("SC_CLK_TCK")


def _ours_s() -> float:
    """CPU seconds used by this process and its waited-for descendants."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _cpu_by_process() -> dict[int, tuple[float, str]]:
    out = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            t = p.cpu_times()
            cmd = " ".join((p.info["cmdline"] or [p.info["name"] or "?"])[:4])
            out[p.pid] = (t.user + t.system, cmd[:60])
        except (psutil.Error, OSError):
            pass
    return out


class ForeignLoad:
    """Context manager: `share` is the fraction of all cores other users' processes used
    while the block ran; `top` names the other processes that ran longest."""

    share: float = 0.0
    cpu_s: float = 0.0
    top: list[str]

    def __init__(self, name_processes: bool = True) -> None:
        self.name_processes = name_processes
        self.top = []

    def __enter__(self) -> ForeignLoad:
        self.t, self.busy, self.ours = time.monotonic(), _busy_s(), _ours_s()
        self.procs = _cpu_by_process() if self.name_processes else {}
        return self

    def __exit__(self, *exc) -> None:
        wall = max(1e-9, time.monotonic() - self.t)
        foreign = (_busy_s() - self.busy) - (_ours_s() - self.ours)
        self.cpu_s = max(0.0, foreign)
        self.share = min(1.0, self.cpu_s / (wall * (os.cpu_count() or 1)))
        if not self.name_processes:
            return
        now = _cpu_by_process()
        mine = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
        deltas = [(now[p][0] - self.procs[p][0], now[p][1]) for p in now
                  if p in self.procs and p not in mine]  # fmt: skip
        # the other processes that ran longest (those alive at both ends): who it was
        self.top = [f"{name} {d:.0f}s" for d, name in sorted(deltas, reverse=True)[:3] if d >= 1]


def foreign_share(seconds: float = 5.0) -> float:
    """Share of all cores other users' processes use now (sampled over `seconds`)."""
    with ForeignLoad(name_processes=False) as load:
        time.sleep(seconds)
    return load.share


def wait_quiet(limit: float, max_wait_s: float, sample_s: float = 5.0) -> float:
    """Wait (at most max_wait_s) until other users use less than `limit` of the CPU;
    returns the last share sampled."""
    deadline = time.monotonic() + max_wait_s
    share = foreign_share(sample_s)
    while share > limit and time.monotonic() < deadline:
        log.info("other users take %.0f%% of the CPU: waiting for a quiet machine", share * 100)
        time.sleep(min(20.0, max(0.0, deadline - time.monotonic())))
        share = foreign_share(sample_s)
    return share
