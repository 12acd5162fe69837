"""Per-sender rate limits on every request a server is sent (exchanges and state pulls
cost it most; pings build a header listing the peers, probes carry 256 KB).

A flood of pulls (10k a second from one client, each snapshotting a unit) made an honest
peer's steps 2x slower. Token buckets bound each sender (its address and claimed id) to
`rate` requests a second with bursts of `burst` (a joiner pulls every unit at once), and
each address to ten times that whatever ids it claims; beyond, a request is dropped
unanswered, counted, and logged (rate-limited, per address). The bucket table is bounded
too: the least recently used buckets are forgotten.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class RateLimiter:
    def __init__(self, rate: float, burst: float, max_keys: int = 4096):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[object, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, key: object, now: float | None = None) -> bool:
        """Take one token from `key`'s bucket; False when it is empty. rate 0: no limit."""
        if self.rate <= 0:
            return True
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            ok = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return ok


class RequestLimits:
    """The two bounds of a server: per (address, id) and per address."""

    def __init__(self, rate: float):
        self.sender = RateLimiter(rate, burst=max(64.0, 2 * rate))
        self.address = RateLimiter(10 * rate, burst=max(640.0, 20 * rate))

    def allow(self, address: str, sender: str, now: float | None = None) -> bool:
        return self.sender.allow((address, sender), now) and self.address.allow(address, now)
