"""Where a run's steps are told: metrics.jsonl (a line a step, always), the loggers the
config asks for (atom/loggers.py), and the terminal: a progress bar on a terminal, log
lines otherwise, and the validation loss as it is measured."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

from tqdm import tqdm

from atom.run_dir import trim_metrics

log = logging.getLogger(__name__)


class RunLog:
    def __init__(
        self, out: Path, start: int, end: int, progress: bool, loggers: list, log_interval: int
    ):
        self.path = Path(out) / "metrics.jsonl"
        self.end, self.progress, self.loggers = end, progress, loggers
        self.log_interval = log_interval
        self.bar = tqdm(total=end, initial=start, disable=not progress, unit="step",
                        dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        self._file = self.path.open("a")

    def step(self, record: dict, postfix: dict) -> None:
        """One finished step's record: to the file, the loggers and the terminal."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for logger in self.loggers:
            logger.log(record)
        done, loss = record["step"], record["loss"]
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
            log.info(
                "step %d/%d loss %.4f lr %.2e %.0f tokens/s device %s",
                done, self.end, loss, record["lr"], record["tokens_per_s"],
                human(record["device_peak_bytes"]),
            )  # fmt: skip
        self.bar.set_postfix(
            loss=f"{loss:.4f}",
            tok_s=f"{record['tokens_per_s']:,.0f}",
            dev=human(record["device_peak_bytes"]),
            **postfix,
            refresh=False,
        )

    def close_bar(self) -> None:
        self.bar.close()

    def rewind(self, step: int) -> None:
        """A rollback to `step`: the records after it leave metrics.jsonl (they are
        trained again) and the bar goes back."""
        self._file.close()
        trim_metrics(self.path, step)
        self._file = self.path.open("a")
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        """The bar, the file and every logger (each closed even if one fails)."""
        self.bar.close()
        try:
            self._file.close()
        finally:
            for logger in self.loggers:
                logger.close()


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)
