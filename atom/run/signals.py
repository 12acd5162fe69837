"""Ctrl+C and SIGTERM during training: stop where nothing is lost (see Interrupts)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager


class Interrupts:
    """Ctrl+C (and SIGTERM, which the CLI routes here) takes effect where nothing is lost:

    - between steps: the step under way finishes, is saved, and the run stops;
    - inside a long step (one that has run for LONG_STEP_S): the step is abandoned between
      two unit visits, within seconds, and the last finished step is saved;
    - during a checkpoint save: the save finishes; the third Ctrl+C abandons it (the
      half-written directory is removed, the previous checkpoint stays).
    A second Ctrl+C outside a save interrupts at once (the engine abandons the step cleanly),
    except while `hold()` says the step is applying its updates (`Engine.committed`): cut
    there, the weights would hold half a step, so it counts as the first and the step ends.
    """

    def __init__(self, hold: Callable[[], bool] = lambda: False):
        self._hold = hold

    LONG_STEP_S = 2.0
    ABANDON_SAVE_AFTER = 3

    def __enter__(self) -> Interrupts:
        self.pending = False
        self.presses_while_saving = 0
        self.save_abandoned = False
        self._saving = False
        self._what = "writing a checkpoint"
        self._step_started = time.monotonic()
        self._installed = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if self._installed:
            signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        # no logging here (the main thread may hold logging's lock): os.write is safe
        if self._saving:
            self.pending = True  # the run stops once the checkpoint is written
            self.presses_while_saving += 1
            left = self.ABANDON_SAVE_AFTER - self.presses_while_saving
            if left <= 0:
                self.save_abandoned = True
                raise KeyboardInterrupt
            os.write(2, f"atom: {self._what}; Ctrl+C {left} more time(s) abandons it (the "
                        "previous checkpoint stays)\n".encode())  # fmt: skip
            return
        if self.pending and not self._hold():
            raise KeyboardInterrupt
        self.pending = True

    def at_step_boundary(self) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self._step_started = time.monotonic()

    def abandon_step(self) -> bool:
        """Asked by the engine between unit visits."""
        return self.pending and time.monotonic() - self._step_started > self.LONG_STEP_S

    @contextmanager
    def saving(self, what: str = "writing a checkpoint"):
        """Ctrl+C is held off while `what` runs (a save, or a rollback's reload: either,
        cut short, would leave a run directory or the weights half done)."""
        self._saving, self.presses_while_saving, self._what = True, 0, what
        try:
            yield
        finally:
            self._saving = False

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
