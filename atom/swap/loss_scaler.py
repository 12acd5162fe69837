"""Dynamic loss scaling for fp16 compute (GPUs without bf16, e.g. RTX 20-series)."""

from __future__ import annotations


class LossScaler:
    """Dynamic loss scaling for fp16 (GPUs without bf16): halve on overflow, double after
    `interval` clean steps."""

    def __init__(self, init: float = 2.0**16, interval: int = 1000):
        self.scale, self.interval, self._good = init, interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self._good = max(self.scale / 2, 1.0), 0
        else:
            self._good += 1
            if self._good >= self.interval:
                self.scale, self._good = self.scale * 2, 0
