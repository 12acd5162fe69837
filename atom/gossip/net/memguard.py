"""Bounds on what connections can hold: memory in unfinished messages, and files.

Memory:  libzmq keeps every frame of a multipart
message until its last frame arrives, and ZMQ_MAXMSGSIZE bounds one frame, not their
number, so a client that never sends the last frame grew a peer by +798 MB in 4 s on
loopback (tests/adversary.py `endless_zmtp`). No socket option bounds it.

The guard watches the process's anonymous resident memory (RssAnon: what malloc holds,
not file pages of the memory-mapped dataset) from the server's I/O thread. Most growth
above the lowest level seen is not an attack: memory the training (or any thread) freed
that the C library still holds, or a step's working memory that comes and goes. So when
it has grown more than `limit` bytes, the guard first gives freed heap back (malloc_trim)
and judges what stays; what stays must still be there `confirm_s` later (unfinished
messages only grow: an endless one grew 60 MB per 50 ms on loopback), while freed memory
and much of a computation's working memory are gone by then. Only then the server
recycles its listening socket: closes it (libzmq frees every pipe and the unfinished messages in
them), gives freed heap back to the kernel (malloc_trim), measures again with the
listener still closed, and listens again on the same endpoint. If that freed the growth,
it was ours; if not, it was the training's (its first steps allocate), and the level is
taken as the new floor. Honest peers reconnect by themselves (ZeroMQ reconnects); an
exchange in flight at that moment fails and is retried. The cost of one recycle is well
under a second without a listener.

Files: every connection holds a file descriptor. When open files pass 3/4 of the soft
limit (which `atom` raises towards the hard one at start), the listener is recycled the
same way, so a flood of connections cannot starve a checkpoint save of a file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import time

import psutil

try:
    import resource
except ImportError:  # not on this platform: open files are not watched
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


class AnonMemory:
    """Anonymous resident memory of this process (RssAnon; RSS where there is no /proc).
    /proc/self/status stays open: under an exhausted open-file limit (a flood of
    connections) the guard must still read it, and it returns its last reading rather
    than fail."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/self/status", os.O_RDONLY)
        except OSError:
            self._fd = None
        self.last = 0
        self.last = self()

    def __call__(self) -> int:
        try:
            if self._fd is not None:
                for line in os.pread(self._fd, 8192, 0).splitlines():
                    if line.startswith(b"RssAnon:"):
                        self.last = int(line.split()[1]) * 1024
                        return self.last
            self.last = psutil.Process().memory_info().rss
        except (OSError, psutil.Error, ValueError):
            pass
        return self.last

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def anon_bytes() -> int:
    """One reading (opens /proc/self/status each time; the guard keeps it open)."""
    reader = AnonMemory()
    try:
        return reader.last
    finally:
        reader.close()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _trim() -> None:
    """Give freed heap back to the kernel (glibc); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def open_files() -> int | None:
    """How many file descriptors this process holds; None where that cannot be counted
    (no /proc, or no descriptor left to list it with)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def files_settle(timeout_s: float, every_s: float = 0.05) -> None:
    """Wait (at most timeout_s) until the count of open files stops falling: libzmq
    closes dropped connections in its own thread, a little after the socket is closed."""
    deadline = time.monotonic() + timeout_s
    time.sleep(min(0.2, timeout_s))  # they start to close a little later, too
    last = open_files()
    while time.monotonic() < deadline:
        time.sleep(every_s)
        now = open_files()
        if now is not None and last is not None and now >= last:
            return
        last = now


class InboundMemoryGuard:
    def __init__(self, limit_bytes: int, every_s: float = 0.05, read=None, trim=_trim,
                 confirm_s: float = 0.02):  # fmt: skip
        self.limit, self.every_s, self.confirm_s = limit_bytes, every_s, confirm_s
        self._suspect: tuple[float, int] | None = None  # (since, level) of growth that stayed
        self.read = read or (AnonMemory() if limit_bytes > 0 else (lambda: 0))
        self.trim = trim
        self.floor = self.level = self.read()
        self._next = self._next_files = 0.0
        self._hold_floor_until = 0.0  # after growth that was not ours: the floor stays up
        _libc()  # loaded now: at a recycle the open-file limit may be exhausted

    def files_over(self, share: float = 0.75, every_s: float = 1.0) -> int:
        """Open files when they pass `share` of the soft limit (or cannot be counted
        because it is exhausted); 0 when fine. Every connection is a file descriptor:
        400 of them under `ulimit -n 256` made a checkpoint save fail with EMFILE."""
        now = time.monotonic()
        if now < self._next_files or resource is None:
            return 0
        self._next_files = now + every_s
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return 0
        try:
            n = len(os.listdir("/proc/self/fd"))
        except FileNotFoundError:  # no /proc: not counted
            return 0
        except OSError:  # EMFILE: the limit itself
            n = soft
        if n <= share * soft:
            return 0
        self._next_files = now + 5.0  # not more often: the files may not be gossip's
        return n

    def files_recycled(self, before: int) -> None:
        """After a recycle for files, with the listener closed: if the count did not come
        down, the files are not gossip's; leave them alone for a minute."""
        time.sleep(0.2)  # libzmq closes the connections in its own thread
        n = open_files()
        if n is None or n > 0.9 * before:
            self._next_files = time.monotonic() + 60.0

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
        if now >= self._hold_floor_until:
            self.floor = min(self.floor, self.level)
        if self.level - self.floor <= self.limit:
            self._suspect = None
            return 0
        # over: freed heap the C library holds is no message; give it back and look again
        self.trim()
        self.level = self.read()
        if self.level - self.floor <= self.limit:
            self._suspect = None
            return 0
        if self._suspect is None:
            self._suspect = (now, self.level)
            self._next = now + self.confirm_s  # an attack grows fast: look again soon
            return 0
        _, seen = self._suspect
        self._suspect = None
        # it fell well back: working memory, not unfinished messages (they only grow; a
        # little noise from other threads' frees is allowed)
        if self.level < seen - self.limit // 4:
            return 0
        return self.level - self.floor

    def settle(self, wait_s: float = 0.1) -> int:
        """With the listener closed: let libzmq free its pipes, trim, measure. Returns the
        bytes freed since over() saw the growth; when that is not most of it, the growth
        was someone else's and the new level becomes the floor."""
        time.sleep(wait_s)
        self.trim()
        level = self.read()
        freed = max(0, self.level - level)
        if level > self.floor + self.limit // 2:
            log.debug("memory grew %d MB for other reasons: new floor", (level - self.floor) >> 20)
            # held for a minute: a training step that allocates and frees more than the
            # limit would otherwise lower the floor again and cost a recycle every step
            self.floor = level
            self._hold_floor_until = time.monotonic() + 60.0
        return freed

    def close(self) -> None:
        if isinstance(self.read, AnonMemory):
            self.read.close()
