"""Where a run's steps are told: metrics.jsonl (a line a step, always), the loggers the
config asks for (atom/run/loggers.py), and the terminal: a progress bar on a terminal, log
lines otherwise, and the validation loss as it is measured.

The terminal's tokens/s is tokens over wall-clock time across the last half minute of
steps (RecentRate), evaluation and saves included: one step's own rate swings with every
step's time, and an average of such rates overstated a run's throughput up to 6x.

A full disk does not end a run here: records that cannot be written wait in memory (the
file is cut back to its last whole line) and go out once there is space again, so the
file keeps one record per step, whole.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import time
from collections import deque
from pathlib import Path

from tqdm import tqdm

from atom.store.run_dir import trim_metrics

log = logging.getLogger(__name__)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
MAX_PENDING = 100_000  # records held while the disk is full (a few hundred bytes each)


class RecentRate:
    """Tokens over wall-clock time across the steps of the last WINDOW_S seconds (at
    least the last one): smoothed, and counting what happens between steps."""

    WINDOW_S = 30.0

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.steps = 0
        self.restart()

    def restart(self) -> None:
        """From now (a rollback: the steps before it are trained again)."""
        self._marks = deque([(time.perf_counter(), self.steps)])  # (time, steps by then)

    def step(self) -> float:
        """A step ended now; the rate over the window up to it."""
        now = time.perf_counter()
        self.steps += 1
        self._marks.append((now, self.steps))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.WINDOW_S:
            self._marks.popleft()
        t0, n0 = self._marks[0]
        return (self.steps - n0) * self.tokens_per_step / max(now - t0, 1e-9)


class RunLog:
    def __init__(
        self,
        out: Path,
        start: int,
        end: int,
        progress: bool,
        loggers: list,
        log_interval: int,
        tokens_per_step: int,
    ):
        self.path = Path(out) / "metrics.jsonl"
        self.rate = RecentRate(tokens_per_step)
        self.started = time.perf_counter()  # the log lines' elapsed time counts from here
        self.end, self.progress, self.loggers = end, progress, loggers
        self.log_interval = log_interval
        self.bar = tqdm(total=end, initial=start, disable=not progress, unit="step",
                        dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[bytes] = []  # records the disk had no space for yet
        self.told = start  # the newest step whose record is in (or bound for) the file

    def _write(self) -> None:
        """Append the pending records whole, or (disk full) none of them."""
        data = b"".join(self._pending)
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            os.ftruncate(self._fd, start)  # no half line left behind
            if len(self._pending) == 1:  # said once per full-disk spell
                log.warning("%s: no space left on the disk; records are kept in memory and "
                            "written when there is space again", self.path)  # fmt: skip
            if len(self._pending) > MAX_PENDING:
                del self._pending[: len(self._pending) - MAX_PENDING]
            return
        if len(self._pending) > 1:
            log.info("%s: %d held records written", self.path, len(self._pending))
        self._pending.clear()

    def step(self, record: dict, postfix: dict) -> None:
        """One finished step's record: to the file, the loggers and the terminal."""
        self._pending.append((json.dumps(record) + "\n").encode())
        self.told = record["step"]
        self._write()
        for logger in self.loggers:
            logger.log(record)
        done, loss = record["step"], record["loss"]
        rate = self.rate.step()
        self.bar.update(1)
        if "val_loss" in record:  # said as measured, whatever the log cadence
            val = record["val_loss"]
            line = (
                f"step {done}: val loss {val:.4f} (perplexity "
                f"{math.exp(min(val, 50)):.2f}), train loss {loss:.4f}"
            )
            if self.progress:
                self.bar.write(f"atom: {line}", file=sys.stderr)
            else:
                log.info(line)
        if not self.progress and (done % self.log_interval == 0 or done == self.end):
            # no terminal (a log file, nohup, a job): what the bar shows, in the line
            left = (self.end - done) * self.rate.tokens_per_step / max(rate, 1e-9)
            log.info(
                "step %d/%d loss %.4f lr %.2e %.0f tokens/s device %s elapsed %s ETA %s",
                done, self.end, loss, record["lr"], rate,
                human(record["device_peak_bytes"]),
                tqdm.format_interval(time.perf_counter() - self.started),
                tqdm.format_interval(left),
            )  # fmt: skip
        self.bar.set_postfix(
            loss=f"{loss:.4f}",
            tok_s=f"{rate:,.0f}",
            dev=human(record["device_peak_bytes"]),
            **postfix,
            refresh=False,
        )

    def close_bar(self) -> None:
        self.bar.close()

    def rewind(self, step: int) -> None:
        """A rollback to `step`: the records after it leave metrics.jsonl (they are
        trained again) and the bar goes back."""
        self._pending = [r for r in self._pending if json.loads(r)["step"] <= step]
        if self._pending:
            self._write()
        os.close(self._fd)
        trim_metrics(self.path, step)
        self.told = step
        self.rate.restart()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        """The bar, the file and every logger (each closed even if one fails)."""
        self.bar.close()
        try:
            if self._fd >= 0:
                if self._pending:
                    self._write()
                if self._pending:
                    log.warning("%s: %d records could not be written (no space left on the "
                                "disk)", self.path, len(self._pending))  # fmt: skip
                os.close(self._fd)
                self._fd = -1
        finally:
            for logger in self.loggers:
                logger.close()


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)
