"""DiskTier: each unit's cold state (master weights, optimizer moments) in a file on a
user-given directory (`swap.disk_dir`), paged into a few RAM slots around its update.

What stays in RAM all the time is what a step touches every pass: the compute-dtype copy
that crosses the bus and the gradient. What a unit needs only for its update (master, and
Adam's moments, 12 bytes per parameter in fp32 state, 6 in compact state) lives on disk,
read ahead of the update on a reader thread and written back behind it on a writer thread,
so the host worker that runs updates finds it in RAM and the I/O overlaps the updates of
other units, as the H2D copies overlap compute. A second tier can hold some units' compute
copies too (`swap.disk_weights`, atom/swap/weights.py), read ahead of their loads.

Mechanism: a unit's cold tensors are tensor *objects* that the optimizer and the host
store hold on to (a torch AdamW's params and state, CompactAdamW's codes, master). Paging
a unit in re-points them (`Tensor.set_`) into a slot; paging it out re-points them to an
empty storage, so a stray use fails instead of reading stale memory. One record per unit,
regions aligned to 4 KiB, one file per unit, preallocated; O_DIRECT where the filesystem
supports it (so a benchmark measures the disk, not the page cache), buffered otherwise.

The tier is working state, not a checkpoint: checkpoints are written from it (each unit
paged in, copied out) in the usual format, and a run resumes from a checkpoint, so a crash
in the middle of a tier write loses nothing that a resume needs. Its directory is removed
on close; one left by a killed run is removed by the next run that finds its process gone.
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
from pathlib import Path

import torch

from atom.ground.errors import ConfigError
from atom.optim import Region
from atom.swap.pinned import ALIGN  # a page: O_DIRECT wants aligned buffers, offsets, lengths
from atom.swap.pinned import page_aligned as _aligned

log = logging.getLogger(__name__)

PREFIX = "atom-tier-"


class UnitRecord:
    """The layout of one unit's cold state."""

    def __init__(self, regions: list[Region]):
        self.regions: list[tuple[Region, int]] = []
        offset = 0
        for region in regions:
            self.regions.append((region, offset))
            offset = _aligned(offset + region.numel * region.dtype.itemsize)
        self.nbytes = max(offset, ALIGN)

    def point_into(self, storage: torch.UntypedStorage, base: int) -> None:
        for region, offset in self.regions:
            elem = region.dtype.itemsize
            for tensor, at, shape in region.views:
                stride = torch.empty(shape, device="meta").stride()
                tensor.set_(storage, (base + offset) // elem + at, shape, stride)

    def point_away(self) -> None:
        for region, _ in self.regions:
            for tensor, _, _ in region.views:
                tensor.set_(torch.empty(0, dtype=tensor.dtype).untyped_storage(), 0, (0,), (1,))


def _remove_stale(directory: Path) -> None:
    """Tier directories of runs whose process is gone (killed, crashed)."""
    for entry in directory.glob(PREFIX + "*"):
        try:
            pid = int(entry.name[len(PREFIX) :].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive: another run's
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        log.info("removed %s left by a run that is gone", entry)


class DiskTier:
    """Records on disk, `n_slots` of them in RAM at a time.

    prefetch(u) queues a read (in the order updates will ask); acquire(u) waits until u is
    in a slot (reading it now if nobody asked before); release(u, dirty) queues the write
    back (if dirty) and frees the slot once it is on disk. Reads of a unit wait for its
    pending write, so a unit never comes back older than it went out.

    Acquires are counted: a second acquire of a unit in a slot shares that slot (a weights
    record's next load can come while its update still holds it), a release that leaves
    holders changes nothing but `dirty` (ORed), and the last one writes and frees."""

    def __init__(
        self,
        directory: str | Path,
        records: list[UnitRecord] | dict[int, UnitRecord],
        n_slots: int = 3,
        alloc: Callable[[list[tuple[int, torch.dtype]]], list[torch.Tensor]] | None = None,
    ):
        """alloc: the backend's `alloc_host_many` (page-locked slots on CUDA, so a card
        update's state copies are DMA from the slot itself); None: anonymous mmaps."""
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise ConfigError(
                f"swap.disk_dir {root} is not a directory; create it or point swap.disk_dir "
                "at a directory on a fast disk"
            )
        _remove_stale(root)
        self.records = records  # indexed by unit either way
        if not isinstance(records, dict):  # a list: units 0..n-1; a dict: some units
            records = dict(enumerate(records))
        self._by_unit = records
        total = sum(r.nbytes for r in records.values())
        free = shutil.disk_usage(root).free
        if total > free:
            raise ConfigError(
                f"swap.disk_dir {root} has {free / 2**30:.1f} GiB free but the disk tier needs "
                f"{total / 2**30:.1f} GiB; free space there or choose another directory"
            )
        self.dir = root / f"{PREFIX}{os.getpid()}-{id(self):x}"
        self.dir.mkdir()
        # removed at interpreter exit too, if close() never ran (an exception on the way out)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.direct = False
        self._fds: dict[int, int] = {}
        for i, r in records.items():
            self._fds[i] = self._create(i, r.nbytes, first=not self._fds)
        self._tensors = _slots(max(r.nbytes for r in records.values()), max(2, n_slots), alloc)
        self._mem = [memoryview(t.numpy()) for t in self._tensors]  # for preadv and pwrite
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(self._mem)):
            self._free.put(i)
        self._lock = threading.Lock()
        self._slot_of: dict[int, int] = {}  # unit -> slot, once its read is done
        self._loaded: dict[int, threading.Event] = {}  # unit -> read done
        self._written: dict[int, threading.Event] = {}  # unit -> its last write done
        self._holds: dict[int, int] = {}  # unit -> acquires not yet released
        self._dirty: set[int] = set()  # held units a holder has changed
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self._closing = False
        self.bytes_read = 0
        self.bytes_written = 0
        self._threads = [
            threading.Thread(target=self._reader, name="atom-tier-read", daemon=True),
            threading.Thread(target=self._writer, name="atom-tier-write", daemon=True),
        ]
        for t in self._threads:
            t.start()
        for record in records.values():
            record.point_away()

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() for t in self._tensors)

    @property
    def disk_bytes(self) -> int:
        return sum(r.nbytes for r in self._by_unit.values())

    def _create(self, index: int, nbytes: int, first: bool) -> int:
        path = self.dir / f"unit_{index:03d}.bin"
        flags = os.O_RDWR | os.O_CREAT
        fd = -1
        if hasattr(os, "O_DIRECT") and (first or self.direct):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError:  # tmpfs and some filesystems refuse O_DIRECT
                fd = -1
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserved now: no ENOSPC mid-run; reads zeros
        except OSError as err:
            os.close(fd)
            raise ConfigError(
                f"cannot reserve {nbytes / 2**20:.0f} MiB in {self.dir} ({err.strerror}); "
                "free space there or choose another swap.disk_dir"
            ) from None
        return fd

    # ------------------------------------------------------------------ threads
    def _reader(self) -> None:
        while True:
            item = self._reads.get()
            if item is None:
                return
            unit, fresh = item
            try:
                self._written[unit].wait()
                slot = self._take_slot()
                if slot is None:
                    return  # closing: a read nobody will acquire any more
                nbytes = self.records[unit].nbytes
                if fresh:  # about to be overwritten whole: zeros, as a new record reads
                    self._tensors[slot][:nbytes].zero_()
                elif self.error is None:
                    view = self._mem[slot][:nbytes]
                    got = os.preadv(self._fds[unit], [view], 0)
                    if got != nbytes:
                        raise OSError(f"short read of unit {unit}: {got} of {nbytes} bytes")
                    self.bytes_read += nbytes
                with self._lock:
                    self._slot_of[unit] = slot
            except BaseException as err:  # surfaced by acquire()
                self.error = err
                log.exception("disk tier read failed")
            finally:
                self._loaded[unit].set()

    def _take_slot(self) -> int | None:
        while True:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                if self._closing:
                    return None

    def _writer(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            unit, slot, dirty, after = item
            try:
                if after is not None:  # a reader of the slot (a copy to the device) is done
                    after()
                if dirty and self.error is None:
                    nbytes = self.records[unit].nbytes
                    view = self._mem[slot][:nbytes]
                    written = os.pwrite(self._fds[unit], view, 0)
                    if written != nbytes:
                        raise OSError(f"short write of unit {unit}: {written} of {nbytes} bytes")
                    self.bytes_written += nbytes
            except BaseException as err:
                self.error = err
                log.exception("disk tier write failed")
            finally:
                if slot is not None:
                    self._free.put(slot)
                    self._written[unit].set()

    # ------------------------------------------------------------------ API
    def prefetch(self, unit: int, fresh: bool = False) -> None:
        """Queue unit's read; reads run in the order asked, so ask in update order.
        fresh: the caller overwrites the record whole (weights loaded or initialised,
        moments zero): the slot is zero-filled instead of read."""
        with self._lock:
            if unit in self._loaded:
                return  # queued or resident
            self._loaded[unit] = threading.Event()
            self._written.setdefault(unit, _done_event())
        self._reads.put((unit, fresh))

    def acquire(self, unit: int, fresh: bool = False) -> None:
        """Block until unit's cold tensors point into a RAM slot."""
        self.prefetch(unit, fresh)
        self._loaded[unit].wait()
        if self.error is not None:
            raise RuntimeError("the disk tier failed (see the log)") from self.error
        with self._lock:
            slot = self._slot_of[unit]
            self._holds[unit] = self._holds.get(unit, 0) + 1
        slot_bytes = self._tensors[slot]  # a slice of a pinned arena's storage, on CUDA
        self.records[unit].point_into(slot_bytes.untyped_storage(), slot_bytes.storage_offset())

    def release(
        self, unit: int, dirty: bool = True, after: Callable[[], None] | None = None
    ) -> None:
        """Unit is done with: write it back (if changed), then free its slot. `after`: run
        on the writer thread before the slot is written or freed (wait for a copy still
        reading it)."""
        with self._lock:
            held = self._holds.get(unit, 1) - 1
            if dirty:
                self._dirty.add(unit)
            if held > 0:
                self._holds[unit] = held
                if after is not None:  # the slot outlives this reader: wait for it still
                    self._writes.put((unit, None, False, after))
                return
            self._holds.pop(unit, None)
            dirty = unit in self._dirty
            self._dirty.discard(unit)
            slot = self._slot_of.pop(unit)
            del self._loaded[unit]
            self._written[unit] = threading.Event()
        self.records[unit].point_away()
        self._writes.put((unit, slot, dirty, after))

    def discard(self, unit: int) -> None:
        """A record read ahead that no update will take (the update skipped, the step
        abandoned): once its read is done, the slot goes back unwritten. Nothing if it
        was never asked for. Discard in the order the reads were asked: a later read
        may wait for the slot an earlier one holds."""
        with self._lock:
            loaded = self._loaded.get(unit)
        if loaded is None:
            return
        loaded.wait()
        with self._lock:
            if self._holds.get(unit):  # someone acquired it after all: theirs to release
                return
            if unit not in self._slot_of:  # the read failed (self.error): no slot to free
                del self._loaded[unit]
                return
        self.release(unit, dirty=False)

    def discard_unheld(self) -> None:
        """discard() every record read or queued that nobody holds, in the order asked."""
        with self._lock:
            units = [u for u in self._loaded if not self._holds.get(u)]
        for unit in units:
            self.discard(unit)

    def flush(self) -> None:
        """Wait for every queued write."""
        with self._lock:
            pending = list(self._written.values())
        for event in pending:
            event.wait()
        if self.error is not None:
            raise RuntimeError("the disk tier failed (see the log)") from self.error

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._closing = True
            self._reads.put(None)
            self._writes.put(None)
            for t in self._threads:
                t.join(timeout=30)
            for fd in self._fds.values():
                os.close(fd)
            self._finalizer()  # removes the directory, once


def _slots(nbytes: int, n: int, alloc: Callable | None) -> list[torch.Tensor]:
    """`n` page-aligned byte tensors of `nbytes`, as O_DIRECT wants them: anonymous mmaps,
    or from `alloc` (a pinned arena's slices are aligned; torch's pinned fallback buffers
    need not be, so each is asked a page longer and cut at the first boundary)."""
    if alloc is None:
        return [torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8) for _ in range(n)]
    out = []
    for raw in alloc([(nbytes + ALIGN, torch.uint8)] * n):
        start = -raw.data_ptr() % ALIGN
        out.append(raw[start : start + nbytes])
    return out


def _done_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event
