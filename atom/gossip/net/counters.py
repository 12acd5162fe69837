"""Counters and rate-limited logging for the wire (the status file reads the counters)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any


class Counters:
    """Thread-safe event counters (messages, bytes, exchanges, rejections by reason)."""

    def __init__(self) -> None:
        self._c: Counter[str] = Counter()
        self._lock = threading.Lock()

    def inc(self, key: str, n: int | float = 1) -> None:
        with self._lock:
            self._c[key] += n

    def get(self, key: str) -> float:
        with self._lock:
            return self._c.get(key, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._c)


class LogLimiter:
    """Log a recurring warning at most once per `every` seconds per key, with a count:
    a misconfigured client retrying its handshake ten times a second must not flood logs."""

    def __init__(self, log: logging.LoggerAdapter | logging.Logger, every: float = 10.0):
        self.log = log
        self.every = every
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self.every:
                self._skipped[key] += 1
                return
            self._last[key] = now
            skipped, self._skipped[key] = self._skipped[key], 0
        suffix = f" (+{skipped} similar since last report)" if skipped else ""
        self.log.warning(msg + suffix, *args)
