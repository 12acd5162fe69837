"""HostWorker: the one thread that does host-side work on units (landing gradients,
norms, optimizer steps), in submission order, so the training thread never waits for it
except where a step needs the result (the global norm, a unit's update before its next
copy). An error is kept and re-raised in the training thread.

A job may come with a `cleanup` that runs whatever happens to the job: after it, after it
failed, or in its place when an earlier job failed and the rest are skipped. Landings use
it to hand their D2H staging chunks back: a chunk held by a skipped landing would leave
the training thread waiting for one that never comes.

`inline=True` (the CPU backend) runs each job at once on the submitting thread, with the
same contract: the job's error is kept (later submits and drains raise it) and raised
now, and its cleanup runs in every case."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from atom.ground.threads import start_helper

log = logging.getLogger(__name__)


class _DrainMarker:
    def __init__(self) -> None:
        self.done = threading.Event()


class HostWorker:
    """One thread for host-side work on units (accumulate grads, optimizer steps), in
    submission order. An error is kept and re-raised in the training thread."""

    def __init__(self, on_error: Callable[[], None], threads: int = 1, inline: bool = False):
        self._q: queue.Queue = queue.Queue()
        self._on_error: Callable[[], None] | None = on_error
        self.error: BaseException | None = None
        self.inline = inline
        self._thread = None if inline else start_helper(self._run, "atom-host-opt", threads)

    def submit(self, fn: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
        """Queue `fn` (inline: run it now); `cleanup` runs after it in every case (also
        when this refuses it)."""
        error = self.error  # read once: the worker may fail meanwhile
        if error is not None:
            if cleanup is not None:
                _run_cleanup(cleanup)
            raise RuntimeError(f"host optimizer thread failed: {error!r}") from error
        if self.inline:
            self._run_inline(fn, cleanup)
            return
        self._q.put((fn, cleanup))  # failed since? the worker skips it and runs cleanup

    def _run_inline(self, fn: Callable[[], None], cleanup: Callable[[], None] | None) -> None:
        try:
            fn()
        except Exception as err:  # kept, as the thread keeps it; an interrupt just goes up
            self._fail(err)
            raise RuntimeError(f"host optimizer thread failed: {err!r}") from err
        finally:
            if cleanup is not None:
                _run_cleanup(cleanup)

    def _fail(self, err: BaseException) -> None:
        self.error = err
        log.error("host optimizer thread failed: %r", err, exc_info=err)
        callback = self._on_error  # read once: close() may clear it
        if callback is not None:
            callback()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"host optimizer thread failed: {self.error!r}") from self.error

    def drain(self, timeout: float = 600.0) -> None:
        if self.inline:  # every job has run
            self.check()
            return
        marker = _DrainMarker()
        self._q.put(marker)
        if not marker.done.wait(timeout):
            raise RuntimeError("host optimizer thread did not finish its work in time")
        self.check()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, _DrainMarker):
                item.done.set()
                continue
            fn, cleanup = item
            try:
                if self.error is None:  # after a failure, skip work but keep answering drain()
                    fn()
            except BaseException as err:
                self._fail(err)
            finally:
                if cleanup is not None:
                    _run_cleanup(cleanup)

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=30)
        self._on_error = None  # the callback is the engine's: no cycle keeps it alive


def _run_cleanup(cleanup: Callable[[], None]) -> None:
    try:
        cleanup()
    except Exception:  # a cleanup must not hide the job's own error
        log.exception("host worker cleanup failed")
