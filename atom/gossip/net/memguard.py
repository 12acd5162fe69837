"""A bound on what unfinished messages can hold: libzmq keeps every frame of a multipart
message until its last frame arrives, and ZMQ_MAXMSGSIZE bounds one frame, not their
number, so a client that never sends the last frame grew a peer by +798 MB in 4 s on
loopback (tests/adversary.py `endless_zmtp`). No socket option bounds it.

The guard watches the process's anonymous resident memory (RssAnon: what malloc holds,
not file pages of the memory-mapped dataset) from the server's I/O thread. When it has
grown more than `limit` bytes above the lowest level seen, the server recycles its
listening socket: closes it (libzmq frees every pipe and the unfinished messages in
them), gives freed heap back to the kernel (malloc_trim), measures again with the
listener still closed, and listens again on the same endpoint. If that freed the growth,
it was ours; if not, it was the training's (its first steps allocate), and the level is
taken as the new floor. Honest peers reconnect by themselves (ZeroMQ reconnects); an
exchange in flight at that moment fails and is retried. The cost of one recycle is well
under a second without a listener.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import time

import psutil

log = logging.getLogger(__name__)


def anon_bytes() -> int:
    """Anonymous resident memory of this process (RssAnon; RSS where there is no /proc)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def _trim() -> None:
    """Give freed heap back to the kernel (glibc); a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class InboundMemoryGuard:
    def __init__(self, limit_bytes: int, every_s: float = 0.05, read=anon_bytes, trim=_trim):
        self.limit, self.every_s = limit_bytes, every_s
        self.read, self.trim = read, trim
        self.floor = self.level = read()
        self._next = 0.0

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def over(self) -> int:
        """Bytes grown past the floor when that is over the limit (checked at most every
        `every_s`); 0 when fine."""
        now = time.monotonic()
        if not self.enabled or now < self._next:
            return 0
        self._next = now + self.every_s
        self.level = self.read()
        self.floor = min(self.floor, self.level)
        grown = self.level - self.floor
        return grown if grown > self.limit else 0

    def settle(self, wait_s: float = 0.3) -> int:
        """With the listener closed: let libzmq free its pipes, trim, measure. Returns the
        bytes freed since over() saw the growth; when that is not most of it, the growth
        was someone else's and the new level becomes the floor."""
        time.sleep(wait_s)
        self.trim()
        level = self.read()
        freed = max(0, self.level - level)
        if level > self.floor + self.limit // 2:
            log.debug("memory grew %d MB for other reasons: new floor", (level - self.floor) >> 20)
            self.floor = level
        return freed
