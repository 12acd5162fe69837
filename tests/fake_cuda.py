"""A torch.cuda for a machine without a GPU that checks the stream ordering code asks for.

CudaBackend's correctness rests on ordering it cannot see on a CPU: a copy into a device
slot must wait (on its stream) for an event recorded after the last compute that read the
slot; compute must wait for the copy's event before reading it; a device-to-host copy must
wait for the compute that wrote its source. Here the streams, events and pinned memory of
torch.cuda are faked on the CPU, every tensor operation runs at once (so the numbers are
the CPU's), and a race detector checks what the real GPU would have been free to reorder:

- Each stream has a vector clock; an op on a stream ticks it; `Event.record(stream)`
  snapshots the stream's clock, `Stream.wait_event(ev)` merges the snapshot in, and a host
  `Event.synchronize()` / `torch.cuda.synchronize()` merges it into the calling thread's
  current stream (work issued after a host wait starts after it).
- Every aten op (a TorchDispatchMode, per thread: the compute thread for the whole run,
  the copy thread inside `torch.cuda.stream(...)`) is attributed to the thread's current
  stream, and its reads and writes of *device* memory are checked: a read must come after
  the last write by another stream (in the clock order), a write after the last write and
  every read since by other streams. A violation is recorded, never raised: the test
  asserts the list is empty, and that a backend with a wait removed fills it.
- Device memory is what the backend allocates on the device (the slots) and what ops on
  the streams create; host memory (the host store, the pinned arena, batches) is written
  by host code in program order and is not tracked. A storage freed and reallocated
  starts a new history (what `record_stream` guards on a GPU is not modelled).

Not checked: host threads reading pinned memory a device stream wrote (the host worker
consuming D2H staging buffers after `wait_host`): host threads other than the compute
thread run unwatched, and host memory has no history.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class _History:
    ref: StorageWeakRef
    write: tuple[str, int] | None = None  # (stream, its clock) of the last write
    reads: dict[str, int] = field(default_factory=dict)  # stream -> clock, since the write


class StreamSimulator:
    def __init__(self) -> None:
        self.clocks: dict[str, dict[str, int]] = {}
        self.device: dict[int, _History] = {}  # storage data_ptr -> history
        self.violations: list[str] = []
        self.ops = 0
        self._lock = threading.RLock()
        self._local = threading.local()
        self.compute = FakeStream(self, "compute")

    # -------------------------------------------------------------- streams
    def current(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.compute

    def merge(self, stream: str, snapshot: dict[str, int]) -> None:
        with self._lock:
            clock = self.clocks[stream]
            for name, tick in snapshot.items():
                clock[name] = max(clock.get(name, 0), tick)

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

    # -------------------------------------------------------------- memory
    def device_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Mark `t`'s storage as device memory (a backend's alloc_device)."""
        with self._lock:
            s = t.untyped_storage()
            self.device[s.data_ptr()] = _History(StorageWeakRef(s))
        return t

    def _history(self, t: torch.Tensor, fresh: bool) -> _History | None:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr == 0:  # an empty tensor: no memory to order
            return None
        h = self.device.get(ptr)
        if h is not None and h.ref.expired():  # freed and reallocated: a new tensor
            h = None
            del self.device[ptr]
        if h is None and fresh:
            h = self.device[ptr] = _History(StorageWeakRef(s))
        return h

    def access(self, stream: str, op: str, reads, writes, fresh) -> None:
        with self._lock:
            clock = self.clocks[stream]
            clock[stream] += 1
            self.ops += 1
            now = clock[stream]
            for t in fresh:
                h = self._history(t, fresh=True)
                if h is not None:
                    h.write, h.reads = (stream, now), {}
            for t in reads:
                h = self._history(t, fresh=False)
                if h is None:
                    continue  # host memory
                self._after(h.write, stream, clock, f"{op} on {stream} reads", t)
                h.reads[stream] = now
            for t in writes:
                h = self._history(t, fresh=False)
                if h is None:
                    continue
                self._after(h.write, stream, clock, f"{op} on {stream} overwrites", t)
                for reader, tick in h.reads.items():
                    self._after((reader, tick), stream, clock, f"{op} on {stream} overwrites", t)
                h.write, h.reads = (stream, now), {}

    def _after(self, event, stream: str, clock: dict[str, int], what: str, t) -> None:
        if event is None or event[0] == stream:
            return
        other, tick = event
        if clock.get(other, 0) < tick:
            self.violations.append(
                f"{what} {tuple(t.shape)} {t.dtype} before {other}'s op #{tick} that "
                f"{'wrote' if what.endswith('reads') else 'touched'} it was waited for"
            )


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
        self.sim.merge(self.sim.current().name, snapshot)


class FakeEvent:
    sim: StreamSimulator  # set by install

    def __init__(self, *args, **kwargs) -> None:
        self.snapshot: dict[str, int] | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.sim.current()
        with self.sim._lock:
            self.snapshot = dict(self.sim.clocks[stream.name])

    def synchronize(self) -> None:  # the host waits: what this thread issues next follows
        if self.snapshot is not None:
            self.sim.merge(self.sim.current().name, self.snapshot)

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
        out = func(*args, **kwargs)
        schema = func._schema
        returns_alias = any(r.alias_info is not None for r in schema.returns)
        written = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
        if returns_alias and not any(written):
            return out  # a view: no memory is touched
        reads, writes = [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            (writes if written[i] else reads).extend(tensors)
        fresh = (
            []
            if returns_alias
            else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        )
        self.sim.access(self.sim.current().name, str(func), reads, writes, fresh)
        return out


class _FakeCudart:
    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        return 0


def install(monkeypatch) -> StreamSimulator:
    """Replace what CudaBackend asks of torch.cuda; returns the simulator to check."""
    sim = StreamSimulator()
    FakeEvent.sim = sim
    cudart = _FakeCudart()
    real_empty = torch.empty

    def empty(*args, pin_memory: bool = False, **kwargs):  # pinned: plain host memory here
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(sim))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", sim.on)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)

    def synchronize(device=None) -> None:
        with sim._lock:  # RLock: merge takes it again
            everything: dict[str, int] = {}
            for clock in sim.clocks.values():
                for name, tick in clock.items():
                    everything[name] = max(everything.get(name, 0), tick)
            for name in list(sim.clocks):
                sim.merge(name, everything)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)

    def record_stream(self, stream) -> None:
        assert isinstance(stream, FakeStream), "record_stream needs a stream of this device"

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return sim


def cuda_backend(monkeypatch, staging_numel: int, dtype=torch.float32):
    """A real CudaBackend over the fake torch.cuda, computing on the CPU; (backend, sim)."""
    from atom.swap.backend import CudaBackend

    sim = install(monkeypatch)
    backend = CudaBackend(torch.device("cuda", 0), staging_numel, dtype)
    backend.device = torch.device("cpu")  # tensors live in host memory; streams are fake
    alloc = backend.alloc_device
    backend.alloc_device = lambda numel, dt: sim.device_tensor(alloc(numel, dt))
    # `.to(device)` makes a new device tensor on a GPU; on the CPU it would return the
    # pinned buffer itself, which the offload pool hands out again
    fetch = backend.fetch
    backend.fetch = lambda t: fetch(t).clone()
    return backend, sim
