"""The inbound memory guard tells unfinished messages from the process's own memory: an
honest group on loopback logged "dropped every gossip connection: 66 MB held by
unfinished incoming messages" 4-5 times per peer in three minutes, each firing dropping
every peer's connections. Growth that malloc_trim gives back, or that falls again, is
not messages; growth that stays and holds is (tests/test_adversary.py has the attack)."""

from __future__ import annotations

import time

from atom.gossip.net.memguard import InboundMemoryGuard

MB = 1 << 20


class Process:
    """Anonymous memory as the guard reads it: `held` is freed heap the C library keeps
    until a trim; `live` is in use (working memory, or unfinished messages)."""

    def __init__(self):
        self.base, self.held, self.live, self.trims = 500 * MB, 0, 0, 0

    def read(self) -> int:
        return self.base + self.held + self.live

    def trim(self) -> None:
        self.trims += 1
        self.held = 0


def _guard(proc: Process) -> InboundMemoryGuard:
    return InboundMemoryGuard(64 * MB, every_s=0.0, read=proc.read, trim=proc.trim,
                              confirm_s=0.05)  # fmt: skip


def _watch(guard: InboundMemoryGuard, seconds: float, step=None) -> int:
    """How many times the guard would recycle the listener in `seconds` of readings."""
    fired, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        if step:
            step()
        fired += bool(guard.over())
        time.sleep(0.005)
    return fired


def test_freed_heap_the_c_library_holds_is_not_messages():
    proc = Process()
    guard = _guard(proc)
    proc.held = 100 * MB  # a training step freed it; glibc keeps it (the honest case seen)
    assert _watch(guard, 0.3) == 0 and proc.trims == 1
    proc.held = 100 * MB  # and again, at once (the next step): given back again
    assert _watch(guard, 0.3) == 0 and proc.trims == 2


def test_working_memory_that_comes_and_goes_is_not_messages():
    proc = Process()
    guard = _guard(proc)
    phase = [0]

    def step():  # a step's activations: up 100 MB for 30 ms, then freed, again and again
        phase[0] += 1
        proc.live = 100 * MB if phase[0] % 12 < 6 else 0

    assert _watch(guard, 0.5, step) == 0


def test_memory_that_stays_and_grows_is_recycled_at_once():
    proc = Process()
    guard = _guard(proc)

    def step():  # an endless multipart message: frames arrive and are all kept
        proc.live += 2 * MB

    t0 = time.monotonic()
    while not guard.over():
        step()
        time.sleep(0.005)
        assert time.monotonic() - t0 < 2, "never fired"
    assert proc.live < 200 * MB  # cut off within confirm_s of passing the limit
