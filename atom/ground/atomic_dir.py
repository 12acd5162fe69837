"""Directories that appear whole or not at all: a fully written temp directory is
renamed into place, and a directory that already exists is swapped atomically (Linux
renameat2 RENAME_EXCHANGE), so the name never points at nothing, even for an instant.
Small files likewise (`write_text_atomic`): a reader sees the old text or the new."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def write_text_atomic(path: Path, text: str) -> None:
    """Written beside `path` and renamed over it: readers (peers, benches, `atom peers`)
    never see it half-written. The temporary name is this thread's own."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot fsync a directory; nothing more we can do
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2); False where unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def publish(tmp: Path, final: Path) -> Path | None:
    """Move tmp to final; return the directory holding a replaced old checkpoint, if any."""
    if not final.exists():
        os.rename(tmp, final)
        return None
    # Re-saving a step: swap atomically so step_N is never absent, even for an instant.
    if _exchange(tmp, final):
        return tmp
    # Fallback without renameat2: old one aside first, delete only once the new one is in place.
    aside = final.with_name(f".tmp-replaced-{final.name}-{os.getpid()}")
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    return aside
