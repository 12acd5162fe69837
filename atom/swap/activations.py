"""ActivationDisk: offloaded unit inputs on the NVMe tier, for steps whose saved inputs do
not fit the card or host RAM (a 70B step of 64 x 2048 tokens keeps ~86 GB of them).

With `swap.checkpoint` a step keeps only each unit's input per micro-batch for the
backward's recompute. Those that the plan puts on disk go, in the forward, from the
device into one of a few RAM slots and from there to their own place in one preallocated
file (a writer thread); the backward asks for them in the order it visits them, a reader
thread reads ahead into free slots, and each lands on the device again before its unit's
recompute. Why not DiskTier: a record there is a unit's optimizer state, paged in and out
around an update, one file per unit; these are written once and read once per step, many
per unit (one per micro-batch), so one file with a fixed place per (unit, micro-batch).

Order is the contract, as with DiskTier: reads are served in the order they are asked
(`prefetch`, or `get` for one not prefetched), and a read waits for a free slot, so the
backward must `get` in the order it prefetched. A read of a key waits for that key's
write. `discard()` ends a step that will not finish (every read and write drained, every
slot free); `close()` removes the file.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import shutil
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from atom.ground.errors import ConfigError
from atom.swap.disk_tier import PREFIX, _remove_stale
from atom.swap.pinned import ALIGN, page_aligned

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (unit, micro-batch)
INPUT_SLOTS = 4  # RAM slots: the backward reads this many ahead (profiler/tiers.py counts them)


class ActivationDisk:
    """Fixed-size tensors by key in one file on `directory`, `n_slots` of them in RAM."""

    def __init__(
        self,
        directory: str | Path,
        keys: list[Key],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        n_slots: int = INPUT_SLOTS,
        alloc: Callable[[list[tuple[int, torch.dtype]]], list[torch.Tensor]] | None = None,
        device: torch.device | str = "cpu",
        streams: bool | None = None,
    ):
        """alloc: the backend's `alloc_host_many` (pinned slots on CUDA, so copies to and
        from the device run asynchronously); None: ordinary page-aligned memory. device:
        where `get` puts what it reads. streams (default: a CUDA device): copies are issued
        on the current stream without waiting, and ordered with the I/O threads by events."""
        self.device = torch.device(device)
        self.streams = self.device.type == "cuda" if streams is None else streams
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise ConfigError(
                f"swap.disk_dir {root} is not a directory; create it or point swap.disk_dir "
                "at a directory on a fast disk"
            )
        if n_slots < 2:
            raise ValueError(f"ActivationDisk needs at least 2 RAM slots, got {n_slots}")
        _remove_stale(root)
        self.shape, self.dtype = tuple(shape), dtype
        self.nbytes = torch.Size(shape).numel() * dtype.itemsize
        self.stride = page_aligned(max(self.nbytes, 1))
        self.keys = list(keys)
        self._place = {key: i * self.stride for i, key in enumerate(keys)}
        total = len(keys) * self.stride
        free = shutil.disk_usage(root).free
        if total > free:
            raise ConfigError(
                f"swap.disk_dir {root} has {free / 2**30:.1f} GiB free but the offloaded "
                f"unit inputs need {total / 2**30:.1f} GiB; free space there or choose "
                "another directory"
            )
        self.dir = root / f"{PREFIX}{os.getpid()}-acts-{id(self):x}"
        self.dir.mkdir()
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.direct, self._fd = _open_preallocated(self.dir / "inputs.bin", total)
        if alloc is None:  # anonymous mmaps: page-aligned, as O_DIRECT wants
            self._mem = [mmap.mmap(-1, self.stride) for _ in range(n_slots)]
            self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in self._mem]
        else:
            self._bytes = alloc([(self.stride, torch.uint8)] * n_slots)
            self._mem = [b.numpy() for b in self._bytes]
            if self.direct and any(b.data_ptr() % ALIGN for b in self._bytes):
                # a pinned fallback buffer off a page boundary: O_DIRECT would refuse it
                os.close(self._fd)
                self.direct, self._fd = False, os.open(self.dir / "inputs.bin", os.O_RDWR)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(n_slots):
            self._free.put(i)
        # (slot, CUDA event): a slot whose copy to the device may still be reading it
        self._in_flight: list[tuple[int, torch.cuda.Event]] = []
        self._lock = threading.Lock()
        self._writes: dict[Key, Future] = {}
        self._reads: dict[Key, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="atom-acts-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="atom-acts-write")
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def slot_bytes(self) -> int:
        return len(self._mem) * self.stride

    # ------------------------------------------------------------------ slots
    def _take_slot(self) -> int:
        while True:
            with self._lock:
                done = [(s, e) for s, e in self._in_flight if e.query()]
                for item in done:
                    self._in_flight.remove(item)
                    self._free.put(item[0])
                oldest = self._in_flight[0] if self._in_flight else None
            try:
                return self._free.get(timeout=0.05 if oldest is None else 0)
            except queue.Empty:
                if oldest is not None:
                    oldest[1].synchronize()  # the device's read of that slot is done

    def _give_back(self, slot: int, event: torch.cuda.Event | None) -> None:
        if event is None:
            self._free.put(slot)
        else:
            with self._lock:
                self._in_flight.append((slot, event))

    # ------------------------------------------------------------------ I/O
    def _write(self, key: Key, slot: int, copied: torch.cuda.Event | None) -> None:
        try:
            if copied is not None:
                copied.synchronize()  # the device-to-host copy into the slot is done
            view = memoryview(self._mem[slot])[: self.stride]
            n = os.pwrite(self._fd, view, self._place[key])
            if n != self.stride:
                raise OSError(f"short write of unit input {key}: {n} of {self.stride} bytes")
            self.bytes_written += self.stride
        finally:
            self._free.put(slot)

    def _read(self, key: Key) -> int:
        pending = self._writes.get(key)
        if pending is not None:
            pending.result()  # a read never comes back older than the write before it
        slot = self._take_slot()
        try:
            view = memoryview(self._mem[slot])[: self.stride]
            n = os.preadv(self._fd, [view], self._place[key])
            if n != self.stride:
                raise OSError(f"short read of unit input {key}: {n} of {self.stride} bytes")
            self.bytes_read += self.stride
        except BaseException:
            self._free.put(slot)
            raise
        return slot

    # ------------------------------------------------------------------ API
    def put(self, key: Key, t: torch.Tensor) -> None:
        """Keep `t` (on any device) for the backward: copied into a RAM slot now (on the
        current stream, without waiting, on CUDA), written to its place behind."""
        if key not in self._place:
            raise KeyError(f"unit input {key} has no place on the disk")
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(f"unit input {key}: {tuple(t.shape)} {t.dtype}, expected "
                             f"{self.shape} {self.dtype}")  # fmt: skip
        slot = self._take_slot()
        flat = self._bytes[slot][: self.nbytes]
        copied = None
        if self.streams:
            flat.view(self.dtype).view(self.shape).copy_(t, non_blocking=True)
            copied = torch.cuda.Event(blocking=True)  # the writer waits on it: no spinning
            copied.record()
        else:
            flat.view(self.dtype).view(self.shape).copy_(t)
        self._writes[key] = self._writer.submit(self._write, key, slot, copied)

    def prefetch(self, key: Key) -> None:
        """Queue key's read; reads run in the order asked: ask in the order of `get`."""
        if key not in self._writes:  # it would read zeros
            raise KeyError(f"unit input {key} was never put")
        with self._lock:
            if key not in self._reads:
                self._reads[key] = self._reader.submit(self._read, key)

    def get(self, key: Key) -> torch.Tensor:
        """The tensor `put` under key, on the device; its slot is free for the next read."""
        self.prefetch(key)
        with self._lock:
            future = self._reads.pop(key)
        slot = future.result()
        host = self._bytes[slot][: self.nbytes].view(self.dtype).view(self.shape)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        out.copy_(host, non_blocking=self.streams)
        if self.streams:
            event = torch.cuda.Event(blocking=True)
            event.record()  # the slot is read until this copy is done
            self._give_back(slot, event)
        else:
            self._give_back(slot, None)
        return out

    def discard(self) -> None:
        """A step that will not finish: wait for its writes and reads, free every slot."""
        for future in list(self._writes.values()):
            try:
                future.result()
            except BaseException:  # the step is abandoned: what failed is not needed
                log.debug("an abandoned unit input's write failed", exc_info=True)
        self._writes.clear()
        with self._lock:
            reads, self._reads = list(self._reads.values()), {}
        for future in reads:  # in the order asked: each frees a slot for the next
            try:
                self._give_back(future.result(), None)
            except BaseException:
                log.debug("an abandoned unit input's read failed", exc_info=True)

    def flush(self) -> None:
        """Wait for every write (raising the first error)."""
        for future in list(self._writes.values()):
            future.result()

    def close(self) -> None:
        try:
            self.discard()
        finally:
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            os.close(self._fd)
            self._finalizer()


def _open_preallocated(path: Path, nbytes: int) -> tuple[bool, int]:
    """(O_DIRECT?, fd) of a new file of nbytes, reserved now so no ENOSPC comes mid-run."""
    flags = os.O_RDWR | os.O_CREAT
    direct, fd = False, -1
    if hasattr(os, "O_DIRECT"):
        try:
            fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError:  # tmpfs and some filesystems refuse O_DIRECT
            fd = -1
    if fd < 0:
        fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as err:
        os.close(fd)
        raise ConfigError(
            f"cannot reserve {nbytes / 2**20:.0f} MiB in {path.parent} ({err.strerror}); "
            "free space there or choose another swap.disk_dir"
        ) from None
    return direct, fd
