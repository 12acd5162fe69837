"""HostWorker: the one thread that does host-side work on units (landing gradients,
norms, optimizer steps), in submission order, so the training thread never waits for it
except where a step needs the result (the global norm, a unit's update before its next
copy). An error is kept and re-raised in the training thread."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class _DrainMarker:
    def __init__(self) -> None:
        self.done = threading.Event()


class HostWorker:
    """One thread for host-side work on units (accumulate grads, optimizer steps), in
    submission order. An error is kept and re-raised in the training thread."""

    def __init__(self, on_error: Callable[[], None]):
        self._q: queue.Queue = queue.Queue()
        self._on_error = on_error
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="atom-host-opt", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self.check()
        self._q.put(fn)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("host optimizer thread failed") from self.error

    def drain(self, timeout: float = 600.0) -> None:
        marker = _DrainMarker()
        self._q.put(marker)
        if not marker.done.wait(timeout):
            raise RuntimeError("host optimizer thread did not finish its work in time")
        self.check()

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            if isinstance(fn, _DrainMarker):
                fn.done.set()
                continue
            if self.error is not None:
                continue  # after a failure, skip work but keep answering drain()
            try:
                fn()
            except BaseException as err:
                self.error = err
                log.exception("host optimizer thread failed")
                self._on_error()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)
