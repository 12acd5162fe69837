"""The copy thread behind a backend's H2D copies, and the host waits they make: for the
host optimizer to release a unit (its `ready` event), holding the units' locks. Waits are
bounded: a dead thread surfaces as an error, never a hang."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager

from atom.ground.threads import start_helper

log = logging.getLogger(__name__)


class CopyWorker:
    """One thread that runs copy jobs in submission order.

    Jobs may block (waiting for the host optimizer to finish a unit), and that must never
    block the thread that issues compute: that is why copies are issued from here."""

    def __init__(self, name: str, threads: int = 1):
        self._jobs: queue.Queue = queue.Queue()
        # its torch ops: one copy at a time (CPU: a memcpy; CUDA: issuing a DMA)
        self._thread = start_helper(self._run, name, threads)

    def submit(self, job: Callable[[], None], transfer):  # a backend.Transfer, returned
        self._jobs.put((job, transfer))
        return transfer

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, transfer = item
            try:
                job()
            except BaseException as err:  # surfaced to the waiter, never swallowed
                transfer.error = err
                log.exception("copy job failed")
            finally:
                transfer.issued.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)


@contextmanager
def held(locks):
    with ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield


def wait_events(events) -> float:
    """Wait for every event (the host optimizer releasing a unit); seconds waited."""
    if all(ev.is_set() for ev in events):
        return 0.0
    t0 = time.perf_counter()
    for ev in events:
        wait_event(ev)
    return time.perf_counter() - t0


def wait_event(ev: threading.Event) -> None:
    waited = 0.0
    while not ev.wait(timeout=5.0):
        waited += 5.0
        if waited >= 600:
            raise RuntimeError("host optimizer did not release a unit within 10 minutes")
