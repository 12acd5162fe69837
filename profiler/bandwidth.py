"""Bandwidth measurements of this machine: host memory, the link both ways (one way at a
time, and both at once), the card's memory, the NVMe tier's disk. hardware.measure calls
them; each returns bytes/s."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_way(device: torch.device, numel: int, dtype: torch.dtype) -> tuple[float, float]:
    """(H2D, D2H) bytes/s of pinned copies of `numel` elements, each alone."""
    pinned = torch.empty(numel, dtype=dtype, pin_memory=True)
    back = torch.empty(numel, dtype=dtype, pin_memory=True)
    dev = torch.empty(numel, dtype=dtype, device=device)
    dev2 = torch.empty(numel, dtype=dtype, device=device)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        return median_time(lambda: (fn(), torch.cuda.synchronize(device)), 5)

    h2d = pinned.nbytes / timed(lambda: dev.copy_(pinned, non_blocking=True))
    d2h = pinned.nbytes / timed(lambda: back.copy_(dev2, non_blocking=True))
    return h2d, d2h


def measure_card_memory(device: torch.device, nbytes: int = 1 << 28) -> float:
    """The card's memory bandwidth, bytes/s: a large device-to-device copy (it reads and
    writes every byte), as the update on the card streams its state through memory."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(device)

    copy()
    return 2 * nbytes / median_time(copy, 5)


def measure_host_memory(nbytes: int = 1 << 28, reps: int = 5) -> float:
    """Host memory (DRAM) bandwidth, bytes/s: a large memcpy on torch's threads, counted as
    the bytes it reads plus those it writes (2 x `nbytes` a copy). 256 MiB each side by
    default: far past any desktop's cache."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages is not bandwidth
    return 2 * nbytes / median_time(lambda: dst.copy_(src), reps)


def measure_duplex(
    device: torch.device, numel: int, dtype: torch.dtype, alloc=None, reps: int = 3
) -> tuple[float, float]:
    """(H2D while D2H runs, D2H while H2D runs), bytes/s, pinned host buffers, as
    nvbandwidth's bidirectional tests measure them: each direction timed by CUDA events on
    its own stream while a copy twice its size runs the other way on a second stream (so
    the measured copy never runs alone), both streams starting from one event. `alloc(n)`:
    n device elements (tests give the fake CUDA's)."""
    alloc = alloc or (lambda n: torch.empty(n, dtype=dtype, device=device))
    host = {d: torch.empty(2 * numel, dtype=dtype, pin_memory=True) for d in ("up", "down")}
    dev = {d: alloc(2 * numel) for d in ("up", "down")}
    ones = torch.ones(2 * numel, dtype=dtype)
    host["up"].copy_(ones)  # pages touched before any copy reads them
    streams = {d: torch.cuda.Stream(device) for d in ("up", "down")}

    def copy(direction: str, n: int) -> None:
        if direction == "up":
            dev["up"][:n].copy_(host["up"][:n], non_blocking=True)
        else:
            host["down"][:n].copy_(dev["down"][:n], non_blocking=True)

    def once(measured: str) -> float:
        other = "down" if measured == "up" else "up"
        torch.cuda.synchronize(device)
        go = torch.cuda.Event()
        go.record(torch.cuda.current_stream(device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for d in (measured, other):
            streams[d].wait_event(go)
        with torch.cuda.stream(streams[other]):
            copy(other, 2 * numel)
        with torch.cuda.stream(streams[measured]):
            start.record(streams[measured])
            copy(measured, numel)
            end.record(streams[measured])
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3  # ms -> s

    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    out = []
    for measured in ("up", "down"):
        once(measured)  # warm-up
        out.append(nbytes / statistics.median(once(measured) for _ in range(reps)))
    return out[0], out[1]


def copy_bps(dst: torch.Tensor, src: torch.Tensor, reps: int = 5) -> float:
    """What the CPU backend's copies achieve: a memcpy on the computing thread, with its
    team (atom/swap/backend.py: the CPU backend runs its host work inline)."""
    dst.copy_(src)
    return src.nbytes / median_time(lambda: dst.copy_(src), reps)


def measure_disk(directory: str | Path, nbytes: int = 1 << 30, seconds: float = 8.0):
    """(read, write) bytes/s of large sequential transfers in `directory`, as the NVMe tier
    does them: O_DIRECT where the filesystem allows, otherwise buffered with the written
    pages dropped from the page cache before reading back (else the read measures RAM).
    Stops early after about `seconds` each way."""
    import mmap
    import os

    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    path = Path(directory) / f".atom-disk-probe-{os.getpid()}"
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        try:
            fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            fd = os.open(path, flags, 0o600)
        try:
            done, t0 = 0, time.perf_counter()
            while done < nbytes and time.perf_counter() - t0 < seconds:
                done += os.pwrite(fd, buf, done)
            os.fsync(fd)
            write = done / (time.perf_counter() - t0)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got, t0 = 0, time.perf_counter()
            with memoryview(buf) as view:
                while got < done and time.perf_counter() - t0 < seconds:
                    got += os.preadv(fd, [view], got)
            read = got / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
        buf.close()
    return read, write
