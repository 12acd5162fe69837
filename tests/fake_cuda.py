"""A torch.cuda for a machine without a GPU that checks the stream ordering code asks for.

CudaBackend's correctness rests on ordering it cannot see on a CPU: a copy into a device
slot must wait (on its stream) for an event recorded after the last compute that read the
slot; compute must wait for the copy's event before reading it; a device-to-host copy must
wait for the compute that wrote its source; a host thread must wait for a copy's event
before it reads what the copy wrote, reuses the buffer, or frees it. Here the streams,
events and pinned memory of torch.cuda are faked on the CPU, every tensor operation runs
at once (so the numbers are the CPU's), and a race detector checks what the real GPU would
have been free to reorder:

- Each stream has a vector clock; an op on a stream ticks it; `Event.record(stream)`
  snapshots the stream's clock, `Stream.wait_event(ev)` merges the snapshot in. Each host
  thread has a clock too: a host wait (`Event.synchronize()`, `Stream.synchronize()`,
  `torch.cuda.synchronize()`, or reading a device scalar with `.item()`/`float()`) merges
  what it waited for into the thread's clock (and, on the compute thread, into the compute
  stream: work issued after a host wait starts after it). What any host wait has seen is
  *completed*.
- Every aten op (a TorchDispatchMode, per thread: the compute thread under `watch()`, the
  copy thread inside `torch.cuda.stream(...)`, the host worker under `host_watch()`) is
  attributed to the thread's current stream, or to the host for a host-watched thread.
- Device memory is what the backend allocates on the device (the slots) and what ops on
  the streams create. A read must come after the last write by another stream (in the
  clock order), a write after the last write and every read since by other streams. When
  a device storage is freed, every stream other than the one that allocated it must have
  been ordered before the free, or named with `record_stream` (the caching allocator would
  hand the block to the allocating stream's next op while the other is still using it).
- Host memory (the host store, pinned arena, staging, offload buffers, batches) that a
  stream op copies to or from the device carries a pending-copy state: a host thread may
  read it only after waiting for the copy that writes it, and write it only after waiting
  for every copy that reads or writes it; a stream may touch it only in its clock's order;
  and it may not be freed while a copy is pending (not completed).

Violations are recorded, never raised: a test asserts the list is empty, and that a
backend with a wait removed fills it.

Options, to exercise what a CPU never does on its own:
- `sim.copy_delay_s`: a copy into host memory completes that long after it was issued:
  until a host wait sees it, the destination holds 0xFF bytes (NaN in any float dtype),
  and the wait sleeps until the copy's time has come (so back-pressure and waits run).
- `sim.fail_host_register`: cudaHostRegister refuses (the per-buffer pinned fallback and
  its error path run).
- `sim.registered`: the ranges page-locked now (cudaHostRegister minus Unregister).
- Events remember `blocking`; a host wait on a non-blocking event is a violation (it spins
  a core: cudaEventSynchronize busy-waits unless the event was made with blocking=True).
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

HOST = "host"  # the stream name of host-watched threads' ops


@dataclass
class _History:
    ref: StorageWeakRef
    alloc: str = "compute"  # the stream that allocated it (the allocator reuses it there)
    write: tuple[str, int] | None = None  # (stream, its clock) of the last write
    reads: dict[str, int] = field(default_factory=dict)  # stream -> clock, since the write
    users: dict[str, int] = field(default_factory=dict)  # stream -> its last access, ever
    recorded: set[str] = field(default_factory=set)  # streams named by record_stream


@dataclass
class _Copy:
    """A copy by a stream to (write) or from (read) bytes [lo, hi) of a host storage."""

    lo: int
    hi: int
    stream: str
    tick: int
    write: bool
    due: float = 0.0  # copy_delay_s: when its bytes arrive
    data: torch.Tensor | None = None  # copy_delay_s: the bytes, until they arrive


@dataclass
class _HostStorage:
    """Host memory stream ops copied to or from, and those copies not yet completed. One
    storage holds many buffers (the pinned arena): copies are tracked by byte range."""

    ref: weakref.ref  # the UntypedStorage object (torch keeps it while the memory lives)
    shape: tuple
    copies: list[_Copy] = field(default_factory=list)


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) of what `t` covers."""
    size = t.element_size()
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)
    lo = t.storage_offset() * size
    return t.untyped_storage().data_ptr(), lo, lo + (extent if t.numel() else 0) * size


class StreamSimulator:
    def __init__(self) -> None:
        self.clocks: dict[str, dict[str, int]] = {}
        self.device: dict[int, _History] = {}  # storage data_ptr -> history
        self.host: dict[int, _HostStorage] = {}  # host storage address -> its copies
        self.completed: dict[str, int] = {}  # what host waits have seen finish, per stream
        self.violations: list[str] = []
        self.ops = 0
        self.copy_delay_s = 0.0
        self.fail_host_register = False
        self.registered: dict[int, int] = {}  # ptr -> bytes page-locked now
        self._lock = threading.RLock()
        self._local = threading.local()
        self.compute = FakeStream(self, "compute")

    # -------------------------------------------------------------- streams and threads
    def current(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.compute

    def _stream_name(self) -> str:
        if getattr(self._local, "host", False) and getattr(self._local, "stream", None) is None:
            return HOST
        return self.current().name

    def host_clock(self) -> dict[str, int]:
        clock = getattr(self._local, "clock", None)
        if clock is None:
            clock = self._local.clock = {}
        return clock

    def merge(self, stream: str, snapshot: dict[str, int]) -> None:
        with self._lock:
            clock = self.clocks[stream]
            for name, tick in snapshot.items():
                clock[name] = max(clock.get(name, 0), tick)

    def host_wait(self, snapshot: dict[str, int]) -> None:
        """The calling thread waited for everything in `snapshot` to finish."""
        self._sleep_until_due(snapshot)
        with self._lock:
            clock = self.host_clock()
            for name, tick in snapshot.items():
                clock[name] = max(clock.get(name, 0), tick)
                self.completed[name] = max(self.completed.get(name, 0), tick)
            if not getattr(self._local, "host", False):  # the compute thread: its stream too
                self.merge(self.current().name, snapshot)
            self._sweep_host()

    @contextmanager
    def on(self, stream: FakeStream):
        """torch.cuda.stream(s): ops of this thread go to `s`; the checker watches them."""
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        watching = getattr(self._local, "watching", False)
        mode = None if watching else OrderChecker(self)
        try:
            if mode is not None:
                self._local.watching = True
                with mode:
                    yield
            else:
                yield
        finally:
            self._local.stream = before
            if mode is not None:
                self._local.watching = False

    @contextmanager
    def watch(self):
        """Check every op this thread issues (the compute thread: the engine's steps)."""
        self._local.watching = True
        try:
            with OrderChecker(self):
                yield
        finally:
            self._local.watching = False

    @contextmanager
    def host_watch(self):
        """Check every op this thread runs as host work on host memory (the host worker)."""
        self._local.watching = self._local.host = True
        try:
            with OrderChecker(self):
                yield
        finally:
            self._local.watching = self._local.host = False

    # -------------------------------------------------------------- memory
    def device_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Mark `t`'s storage as device memory (a backend's alloc_device), allocated on
        the thread's current stream (the caching allocator's pool of that stream)."""
        with self._lock:
            s = t.untyped_storage()
            self.device[s.data_ptr()] = _History(StorageWeakRef(s), alloc=self.current().name)
        return t

    def record_stream(self, t: torch.Tensor, stream: str) -> None:
        with self._lock:
            h = self._history(t, fresh=False)
            if h is not None:
                h.recorded.add(stream)

    def _history(self, t: torch.Tensor, fresh: bool, stream: str = "compute"):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr == 0:  # an empty tensor: no memory to order
            return None
        h = self.device.get(ptr)
        if h is not None and h.ref.expired():  # freed and reallocated: a new tensor
            self._freed(h, t)
            h = None
            del self.device[ptr]
        if h is None and fresh:
            h = self.device[ptr] = _History(StorageWeakRef(s), alloc=stream)
        return h

    def _use(self, h: _History, t: torch.Tensor, stream: str) -> None:
        """A stream other than the allocating one uses a device storage: judge its free
        when it happens (a finalizer), as the caching allocator would act on it then."""
        if stream != h.alloc and stream not in h.users:
            weakref.finalize(t.untyped_storage(), self._freed_now, h, tuple(t.shape))

    def _freed_now(self, h: _History, shape: tuple) -> None:
        with self._lock:
            self._freed(h, _Shape(shape))

    def _freed(self, h: _History, t) -> None:
        """A device storage is gone: was every other stream using it ordered before the
        free (on its allocating stream), or named by record_stream?"""
        users, h.users = h.users, {}  # judged once
        clock = self.clocks.get(h.alloc, {})
        for other, tick in users.items():
            if other in (h.alloc, HOST) or other in h.recorded:
                continue
            if clock.get(other, 0) < tick and self.completed.get(other, 0) < tick:
                self.violations.append(
                    f"device memory {tuple(t.shape)} allocated on {h.alloc} was freed while "
                    f"{other}'s op #{tick} may still use it (no wait, no record_stream)"
                )

    def sweep_device(self) -> None:
        with self._lock:
            for ptr, h in list(self.device.items()):
                if h.ref.expired():
                    self._freed(h, _Shape(()))
                    del self.device[ptr]

    def _host_storage(self, t: torch.Tensor, create: bool) -> _HostStorage | None:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr == 0:
            return None
        h = self.host.get(ptr)
        if h is not None and h.ref() is not s:  # gone, and the address reused
            self._sweep_host()
            h = self.host.get(ptr)
        if h is None and create:
            h = self.host[ptr] = _HostStorage(weakref.ref(s), tuple(t.shape))
        return h

    @staticmethod
    def _done(stream: str, tick: int, clock: dict[str, int]) -> bool:
        return clock.get(stream, 0) >= tick

    def _sweep_host(self) -> None:
        """Land the late copies that host waits have seen complete, forget completed
        copies, and check storages that are gone: none may go with a copy pending."""
        for ptr, h in list(self.host.items()):
            storage = h.ref()
            pending = []
            for c in h.copies:
                if not self._done(c.stream, c.tick, self.completed):
                    pending.append(c)
                elif c.data is not None and storage is not None:
                    self._land(storage, c)
            if storage is None:
                for c in pending:
                    self.violations.append(
                        f"host memory {h.shape} was freed while {c.stream}'s copy #{c.tick} "
                        f"{'into' if c.write else 'out of'} it was pending (no host wait saw "
                        "it complete)"
                    )
                del self.host[ptr]
            else:
                h.copies = pending

    @staticmethod
    def _land(storage, c: _Copy) -> None:
        """A late copy's bytes arrive (unseen by the checker: the simulator's own op)."""
        data, c.data = c.data, None
        with _disable_current_modes():
            dst = torch.empty(0, dtype=torch.uint8).set_(storage, c.lo, (c.hi - c.lo,))
            dst.copy_(data)

    def _sleep_until_due(self, snapshot: dict[str, int]) -> None:
        with self._lock:
            dues = [c.due for h in self.host.values() for c in h.copies
                    if c.data is not None and self._done(c.stream, c.tick, snapshot)]  # fmt: skip
        if dues:
            time.sleep(max(0.0, max(dues) - time.monotonic()))

    def before(self, reads) -> None:
        """A stream op is about to read host memory: the late copies into it that the
        stream is ordered after have arrived by then."""
        stream = self._stream_name()
        if stream == HOST or not self.copy_delay_s:
            return
        with self._lock:
            clock = self.clocks[stream]
            for t in reads:
                h = self.host.get(t.untyped_storage().data_ptr())
                if h is None or h.ref() is not t.untyped_storage():
                    continue
                _, lo, hi = _span(t)
                for c in h.copies:
                    overlaps = c.data is not None and c.lo < hi and lo < c.hi
                    if overlaps and (c.stream == stream or self._done(c.stream, c.tick, clock)):
                        self._land(h.ref(), c)

    def access(self, op: str, reads, writes, fresh) -> None:
        stream = self._stream_name()
        with self._lock:
            self.ops += 1
            if stream == HOST:
                self._host_op(op, reads, writes)
                return
            clock = self.clocks[stream]
            clock[stream] += 1
            now = clock[stream]
            for t in fresh:
                h = self._history(t, fresh=True, stream=stream)
                if h is not None:
                    h.write, h.reads = (stream, now), {}
                    h.users[stream] = now
            host_reads, host_writes, touches_device = [], [], bool(fresh)
            for t in reads:
                h = self._history(t, fresh=False)
                if h is None:
                    host_reads.append(t)
                    continue
                touches_device = True
                self._after(h.write, stream, clock, f"{op} on {stream} reads", t)
                self._use(h, t, stream)
                h.reads[stream] = h.users[stream] = now
            for t in writes:
                h = self._history(t, fresh=False)
                if h is None:
                    host_writes.append(t)
                    continue
                touches_device = True
                self._after(h.write, stream, clock, f"{op} on {stream} overwrites", t)
                for reader, tick in h.reads.items():
                    self._after((reader, tick), stream, clock, f"{op} on {stream} overwrites", t)
                self._use(h, t, stream)
                h.write, h.reads = (stream, now), {}
                h.users[stream] = now
            if touches_device:  # a copy between the device and host memory
                self._stream_host_access(op, stream, clock, now, host_reads, host_writes)
            if self.ops % 64 == 0:
                self._sweep_host()

    def _stream_host_access(self, op, stream, clock, now, reads, writes) -> None:
        """A copy between the device and host memory, issued to `stream`."""
        for t, write in [(t, False) for t in reads] + [(t, True) for t in writes]:
            h = self._host_storage(t, create=True)
            if h is None:
                continue
            _, lo, hi = _span(t)
            storage, verb = h.ref(), "overwrites" if write else "reads"

            def ordered(c: _Copy) -> bool:
                return c.stream == stream or self._done(c.stream, c.tick, clock)

            for c in h.copies:
                if c.hi <= lo or c.lo >= hi or not (c.write or write):
                    continue
                self._after((c.stream, c.tick), stream, clock, f"{op} on {stream} {verb} host", t)
                if c.data is not None and ordered(c):
                    self._land(storage, c)  # ordered after it: its bytes have arrived
            if write:  # what this copy covers whole and is ordered after is superseded
                h.copies = [
                    c for c in h.copies
                    if not (lo <= c.lo and c.hi <= hi and c.data is None and ordered(c))
                ]  # fmt: skip
            copy = _Copy(lo, hi, stream, now, write)
            if write and self.copy_delay_s > 0 and t.is_contiguous():
                raw = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,))
                copy.due, copy.data = time.monotonic() + self.copy_delay_s, raw.clone()
                raw.fill_(0xFF)  # not there yet: NaN in any float dtype
            h.copies.append(copy)

    def _host_op(self, op: str, reads, writes) -> None:
        """Host work (the host worker): on host memory, after the copies it waited for."""
        clock = self.host_clock()
        for t, write in [(t, False) for t in reads] + [(t, True) for t in writes]:
            h = self._host_storage(t, create=False)
            if h is None:
                continue
            _, lo, hi = _span(t)
            for c in h.copies:
                if c.hi <= lo or c.lo >= hi or not (c.write or write):
                    continue
                if not self._done(c.stream, c.tick, clock):
                    self.violations.append(
                        f"{op} on the host {'overwrites' if write else 'reads'} "
                        f"{tuple(t.shape)} {t.dtype} before waiting for {c.stream}'s copy "
                        f"#{c.tick} {'into' if c.write else 'out of'} it"
                    )

    def _after(self, event, stream: str, clock: dict[str, int], what: str, t) -> None:
        if event is None or event[0] == stream:
            return
        other, tick = event
        if clock.get(other, 0) < tick:
            self.violations.append(
                f"{what} {tuple(t.shape)} {t.dtype} before {other}'s op #{tick} that "
                f"{'wrote' if what.endswith('reads') or what.endswith('host') else 'touched'} "
                "it was waited for"
            )


class _Shape:
    def __init__(self, shape) -> None:
        self.shape = shape


class FakeStream:
    def __init__(self, sim: StreamSimulator, name: str | None = None) -> None:
        self.sim = sim
        with sim._lock:
            self.name = name or f"stream{len(sim.clocks)}"
            sim.clocks[self.name] = {self.name: 0}

    def wait_event(self, event: FakeEvent) -> None:
        if event.snapshot is not None:  # waiting for a never-recorded event: a no-op
            self.sim.merge(self.name, event.snapshot)

    def synchronize(self) -> None:
        with self.sim._lock:
            snapshot = dict(self.sim.clocks[self.name])
        self.sim.host_wait(snapshot)


class FakeEvent:
    sim: StreamSimulator  # set by install

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess=False):
        self.snapshot: dict[str, int] | None = None
        self.blocking = blocking

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.sim.current()
        with self.sim._lock:
            self.snapshot = dict(self.sim.clocks[stream.name])

    def synchronize(self) -> None:  # the host waits: what this thread issues next follows
        if not self.blocking:
            self.sim.violations.append(
                f"{threading.current_thread().name} waits on an event made without "
                "blocking=True: cudaEventSynchronize spins a core for the whole wait"
            )
        if self.snapshot is not None:
            self.sim.host_wait(self.snapshot)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.snapshot is not None and end.snapshot is not None, "an unrecorded event"
        return 1.0  # ms: time is not simulated


class OrderChecker(TorchDispatchMode):
    """Attributes each op to the thread's current stream and checks its memory accesses."""

    def __init__(self, sim: StreamSimulator) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        returns_alias = any(r.alias_info is not None for r in schema.returns)
        written = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
        if returns_alias and not any(written):
            return func(*args, **kwargs)  # a view: no memory is touched
        reads, writes = [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            (writes if written[i] else reads).extend(tensors)
        self.sim.before(reads)
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self._scalar_read(args[0])
        fresh = (
            []
            if returns_alias
            else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        )
        self.sim.access(str(func), reads, writes, fresh)
        return out

    def _scalar_read(self, t: torch.Tensor) -> None:
        """`.item()` / `float(t)` of a device tensor: the host waits for its stream."""
        sim = self.sim
        if sim._stream_name() == HOST:
            return
        with sim._lock:
            h = sim.device.get(t.untyped_storage().data_ptr())
            if h is None:
                return
            snapshot = dict(sim.clocks[sim.current().name])
        sim.host_wait(snapshot)


class _FakeCudart:
    def __init__(self, sim: StreamSimulator) -> None:
        self.sim = sim

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.sim.fail_host_register:
            return 1  # cudaErrorInvalidValue, as a refused page-lock reports
        assert ptr not in self.sim.registered, "page-locked twice"
        self.sim.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        size = self.sim.registered.pop(ptr, None)
        if size is None:
            self.sim.violations.append("cudaHostUnregister of memory that is not registered")
            return 713  # cudaErrorHostMemoryNotRegistered
        with self.sim._lock:  # a DMA into or out of pages unlocked under it: undefined
            for base, h in self.sim.host.items():
                for c in h.copies:
                    pending = not self.sim._done(c.stream, c.tick, self.sim.completed)
                    if pending and base + c.lo < ptr + size and ptr < base + c.hi:
                        self.sim.violations.append(
                            f"cudaHostUnregister of pages {c.stream}'s copy #{c.tick} "
                            f"{'into' if c.write else 'out of'} is still using"
                        )
        return 0


def install(monkeypatch) -> StreamSimulator:
    """Replace what CudaBackend asks of torch.cuda; returns the simulator to check."""
    sim = StreamSimulator()
    FakeEvent.sim = sim
    cudart = _FakeCudart(sim)
    real_empty = torch.empty

    def empty(*args, pin_memory: bool = False, **kwargs):  # pinned: plain host memory here
        t = real_empty(*args, **kwargs)
        if pin_memory:  # host memory, though made on a watched thread
            with sim._lock:
                sim.device.pop(t.untyped_storage().data_ptr(), None)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.current())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(sim))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", sim.on)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)

    def synchronize(device=None) -> None:
        sim.sweep_device()  # frees before the device-wide wait are judged as they stood
        with sim._lock:  # RLock: merge takes it again
            everything: dict[str, int] = {}
            for clock in sim.clocks.values():
                for name, tick in clock.items():
                    everything[name] = max(everything.get(name, 0), tick)
            for name in list(sim.clocks):
                sim.merge(name, everything)
        sim.host_wait(everything)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)

    def record_stream(self, stream) -> None:
        assert isinstance(stream, FakeStream), "record_stream needs a stream of this device"
        sim.record_stream(self, stream.name)

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return sim


def release_staging_early(monkeypatch) -> None:
    """Plant a race: CudaBackend.d2h hands its staging chunks back as soon as their copies
    are issued (at the front of the pool: the very next copy takes them), so the next copy
    overwrites them while the landing that owns them has not read them."""
    from atom.swap.backend import CudaBackend

    real_d2h = CudaBackend.d2h

    def early_release(self, src, after=None, abort=None, dtype=None):
        t = real_d2h(self, src, after, abort, dtype)
        with self._staging.not_empty:
            for buf in t.held:
                self._staging.queue.appendleft(buf)
            self._staging.not_empty.notify()
        t.held = []
        return t

    monkeypatch.setattr(CudaBackend, "d2h", early_release)


def cuda_backend(monkeypatch, staging_numel: int, dtype=torch.float32, watch_host: bool = True):
    """A real CudaBackend over the fake torch.cuda, computing on the CPU; (backend, sim).
    With `watch_host`, the engine's host worker runs under `sim.host_watch()`."""
    from atom.swap import host_worker
    from atom.swap.backend import CudaBackend

    sim = install(monkeypatch)
    if watch_host:
        run = host_worker.HostWorker._run

        def watched_run(self) -> None:
            with sim.host_watch():
                run(self)

        monkeypatch.setattr(host_worker.HostWorker, "_run", watched_run)
    backend = CudaBackend(torch.device("cuda", 0), staging_numel, dtype)
    backend.device = torch.device("cpu")  # tensors live in host memory; streams are fake
    alloc = backend.alloc_device
    backend.alloc_device = lambda numel, dt: sim.device_tensor(alloc(numel, dt))
    # `.to(device)` makes a new device tensor on a GPU; on the CPU it would return the
    # pinned buffer itself, which the offload pool hands out again
    fetch = backend.fetch
    backend.fetch = lambda t: fetch(t).clone()
    return backend, sim
