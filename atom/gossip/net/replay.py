"""Replay protection: each request a peer sends carries a request id (`rid`) unique for
that peer's incarnation (one counter per peer, shared by all its sockets), so a request
seen once is refused when it comes again.

Requests from one sender arrive nearly in order (several threads send), so per (sender,
incarnation) we keep the ids seen within a window below the highest one; an id below
the window, or seen in it, is a replay. A captured exchange sent again four times was
merged four times before this. State is bounded: `window` ids per sender, and at most
`max_senders` senders (the least recently heard forgotten first; a forgotten sender's
old requests could be replayed once more, which needs 4x the peer table of fresh ids).
"""

from __future__ import annotations

import collections
import threading


class ReplayWindow:
    def __init__(self, window: int = 1024, max_senders: int = 1024):
        self.window, self.max_senders = window, max_senders
        # (id, incarnation) -> (highest rid seen, rids seen in (highest - window, highest])
        self._seen: collections.OrderedDict[tuple[str, int], tuple[int, set[int]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def fresh(self, sender: str, incarnation: int, rid: int) -> bool:
        """True the first time (sender, incarnation, rid) is seen; False for a replay or a
        request too old to tell (below the window)."""
        key = (sender, incarnation)
        with self._lock:
            entry = self._seen.get(key)
            if entry is None:
                self._seen[key] = (rid, {rid})
                while len(self._seen) > self.max_senders:
                    self._seen.popitem(last=False)
                return True
            self._seen.move_to_end(key)
            top, seen = entry
            if rid <= top - self.window or rid in seen:
                return False
            seen.add(rid)
            if rid > top:
                top = rid
                floor = top - self.window
                if len(seen) > self.window:  # drop what fell below the window
                    seen = {r for r in seen if r > floor}
            self._seen[key] = (top, seen)
            return True
