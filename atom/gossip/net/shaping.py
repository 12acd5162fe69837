"""Application-level link shaping: emulate slow links between peers on one machine.

Each outgoing link (this peer -> one destination) is a token bucket that may go into
debt: a message of n bytes reserves n tokens and its sender waits until the debt it
leaves is paid, i.e. until the message would have finished crossing a link of that rate
behind everything sent before it. Several threads sending to one destination queue up
behind each other as they would on a real link. Shaping is per sender, so a symmetric
link is configured on both ends (tools/bench/gossip.py does).
"""

from __future__ import annotations

import threading
import time

BURST_BYTES = 64 * 1024  # one socket buffer's worth goes out at once, as on a real link


class TokenBucket:
    def __init__(self, bytes_per_s: float, burst: float = BURST_BYTES):
        self.rate = bytes_per_s
        self.burst = burst
        self._tokens = burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Take n bytes of tokens now; seconds until the link has carried them."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            return max(0.0, -self._tokens / self.rate)


class LinkShaper:
    """Per-destination token buckets. A destination is named by its peer id or endpoint;
    `rates` maps either to Mb/s, and `default_mbps` (0: unlimited) covers the rest. A key
    `a+b` puts destinations a and b behind one shared bucket (one uplink to a remote site)."""

    def __init__(self, default_mbps: float = 0.0, rates: dict[str, float] | None = None):
        self.default_mbps = default_mbps
        self._links: dict[str, tuple[str, float]] = {}  # name -> (bucket key, Mb/s)
        for key, mbps in (rates or {}).items():
            for name in key.split("+"):
                self._links[name] = (key, mbps)
        self._buckets: dict[str, TokenBucket | None] = {}
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.default_mbps > 0 or bool(self._links)

    def _link(self, names: tuple[str, ...]) -> tuple[str, float]:
        for n in names:
            if n in self._links:
                return self._links[n]
        return (names[-1] if names else ""), self.default_mbps

    def _bucket(self, names: tuple[str, ...]) -> TokenBucket | None:
        key, mbps = self._link(names)
        with self._lock:
            if key not in self._buckets:
                self._buckets[key] = TokenBucket(mbps * 1e6 / 8) if mbps > 0 else None
            return self._buckets[key]

    def rate_mbps(self, *names: str) -> float:
        """The configured rate to a destination (0: unlimited)."""
        return self._link(names)[1]

    def delay(self, names: tuple[str, ...], nbytes: int) -> float:
        """Reserve nbytes on the link to this destination; seconds to wait before sending."""
        if not self.active:
            return 0.0
        bucket = self._bucket(tuple(n for n in names if n))
        return bucket.reserve(nbytes) if bucket is not None else 0.0

    def wait(self, names: tuple[str, ...], nbytes: int, stop: threading.Event) -> bool:
        """Sleep until nbytes have crossed the link; False if stop was set meanwhile."""
        delay = self.delay(names, nbytes)
        return not stop.wait(delay) if delay > 0 else not stop.is_set()
