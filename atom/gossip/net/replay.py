"""Replay protection: each request a peer sends carries a request id (`rid`), random and
63 bits wide (RequestIds, shared by all of a peer's sockets), so a request seen once is
refused when it comes again. Random, not counted: a peer's pings show its current rid, and
counted ids let a forger send a peer's next 2,000 in its name, so that the victim's real
requests were then refused as replays. A message refused for any reason (the rate limit
included) does not enter the window (transport.py checks the rid last).

Per (sender, incarnation) we remember the rids seen in the last `horizon_s` seconds (at
most `per_sender` of them, the oldest forgotten first), for at most `max_senders`
senders (the least recently heard forgotten first). No ordering is assumed: a large
exchange drawn early can arrive after a thousand pings, and a forged very high rid
blocks nothing (an earlier version refused every rid below a sliding window, so one
forged rid of 2^62 in a peer's name cut that peer off). A captured exchange sent again
four times was merged four times before this; one replayed after the horizon, or after
its sender was forgotten, would be merged again: in an open group anyone can forge a
fresh message anyway, and in a keyed group CURVE refuses replays from outside.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time


class RequestIds:
    """A peer's request ids: unguessable, so nobody can spend them in its name. Thread-safe
    (every client of a peer draws from one); 2^63 values, so a repeat within the replay
    window (at most a few thousand ids) is as likely as guessing one."""

    def __iter__(self) -> RequestIds:
        return self

    def __next__(self) -> int:
        return secrets.randbits(63)


class ReplayWindow:
    def __init__(self, horizon_s: float = 600.0, per_sender: int = 2048, max_senders: int = 256):
        self.horizon_s, self.per_sender, self.max_senders = horizon_s, per_sender, max_senders
        # (id, incarnation) -> rid -> when it was seen (insertion order = age)
        self._seen: collections.OrderedDict[tuple[str, int], collections.OrderedDict[int, float]]
        self._seen = collections.OrderedDict()
        self._lock = threading.Lock()

    def fresh(self, sender: str, incarnation: int, rid: int, now: float | None = None) -> bool:
        """True the first time (sender, incarnation, rid) is seen within the horizon."""
        now = time.monotonic() if now is None else now
        key = (sender, incarnation)
        with self._lock:
            seen = self._seen.pop(key, None)
            if seen is None:
                seen = collections.OrderedDict()
            self._seen[key] = seen  # most recently heard last
            while len(self._seen) > self.max_senders:
                self._seen.popitem(last=False)
            while seen and (
                len(seen) >= self.per_sender or next(iter(seen.values())) < now - self.horizon_s
            ):
                seen.popitem(last=False)
            if rid in seen:
                return False
            seen[rid] = now
            return True
