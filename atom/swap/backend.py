"""Where copies and compute run: a CUDA backend with streams and events, and a CPU
backend with the same interface built from a copy thread and threading events.

The engine only speaks this interface, so the concurrency it relies on (a copy that
overlaps compute, a slot reused only after the compute that read it has finished) is
exercised by CPU tests in CI, not only on a GPU.

A `Transfer` is a handle to an asynchronous copy. `wait_compute(t)` makes the compute
stream wait for it (on CPU: runs it, or blocks the computing thread); a D2H transfer's
`host_pieces(t)` hands a host thread its data piece by piece as each piece lands.

`inline`: the host work (copies, gradient landings, optimizer steps) runs on the thread
that computes. The CPU backend's "device" is the host's own cores, so a helper thread
overlaps nothing: its OpenMP team only fights the compute's team for the same cores (on 2
cores every helper's memcpy or Adam step slowed the compute's matmuls around it). A
CUDA device computes apart from the host, so there the copies and host work run on
threads of their own, overlapping the device's compute.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from atom.swap.copy_thread import CopyWorker as _CopyWorker
from atom.swap.copy_thread import held as _held
from atom.swap.copy_thread import wait_events as _wait_events
from atom.swap.malloc import keep_freed_blocks
from atom.swap.units import aligned

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    issued: threading.Event = field(default_factory=threading.Event)
    cuda_event: object | None = None  # torch.cuda.Event once issued (CUDA backend)
    error: BaseException | None = None
    result: torch.Tensor | None = None  # CPU D2H: the data itself (no copy is made)
    ready_wait_s: float = 0.0  # H2D: how long the copy waited for the host optimizer
    job: Callable[[], None] | None = None  # a copy not yet run (inline: run when needed)
    # CUDA D2H: (element offset in the unit's layout, host view, its copy's event, staging
    # chunk), in order; a chunk holds one piece per source it takes a part of
    pieces: list = field(default_factory=list)
    held: list = field(default_factory=list)  # staging chunks not yet handed back


def done_transfer(result: torch.Tensor | None = None) -> Transfer:
    t = Transfer(result=result)
    t.issued.set()
    return t


def _wait_issued(t: Transfer) -> None:
    # Bounded waits in a loop: a dead copy thread must surface as an error, not a hang.
    waited = 0.0
    while not t.issued.wait(timeout=5.0):
        waited += 5.0
        if waited >= 600:
            raise RuntimeError("a host<->device copy did not complete within 10 minutes")
    if t.error is not None:
        raise RuntimeError("a host<->device copy failed") from t.error


class Backend:
    """Interface; see CpuBackend and CudaBackend."""

    device: torch.device
    name: str
    inline: bool = False  # host work runs on the computing thread (see the module doc)

    def alloc_device(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def size_staging(self, numel: int, dtype: torch.dtype | None = None) -> None:
        """The largest gradient that will come back at once, in elements of the widest
        dtype that crosses: the engine says it before it asks for host memory (a backend
        without a staging pool ignores it)."""

    def alloc_host_many(self, requests: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
        """Every host buffer that crosses the bus, asked for at once (one arena on CUDA)."""
        return [self.alloc_host(n, dt) for n, dt in requests]

    pinned_bytes: int = 0  # page-locked host bytes this backend holds
    # alloc_host_many's buffers are page-locked (copies from them are DMA): other host
    # buffers that cross the bus (the NVMe tier's slots) are worth taking from it
    pins_host: bool = False

    def record(self) -> object:
        """A marker after the work issued so far on the current stream (the compute
        stream, or the side stream inside `side_stream`): used to guard slot reuse."""
        raise NotImplementedError

    @contextmanager
    def side_stream(self):
        """Device work that overlaps the compute stream's (the card update: memory-bound
        kernels beside the backward's matmuls) runs in here, on a stream of its own that
        starts after the compute issued so far; `record`, `wait_compute` and `d2h` inside
        order against it. Without a device of its own (CPU): the body as it is."""
        yield

    def join_side(self) -> None:
        """The compute stream waits for the side stream's work issued so far."""

    def keep_for_side(self, t: torch.Tensor) -> None:
        """`t`, made on the compute stream, is used on the side stream (record_stream)."""

    def h2d(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: object | None,
        host_ready: list[threading.Event],
        locks: list[threading.Lock] = (),
    ) -> Transfer:
        """Copy host `src` into device `dst` once `after` (compute marker) has passed and
        every `host_ready` event (the optimizer finished writing `src`) is set. The copy
        runs holding `locks` (in the order given), so a writer that takes them too (peer
        averaging) never lands half-way through a copy."""
        raise NotImplementedError

    def d2h(
        self,
        src: torch.Tensor | list[torch.Tensor],
        after: object | None = None,
        abort: Callable[[], None] | None = None,
        dtype: torch.dtype | None = None,
    ) -> Transfer:
        """Copy device `src` (one flat tensor, or a unit's parameters in unit order, placed
        as the unit's flat buffer places them: atom/swap/units.py) to host; `host_pieces`
        hands the data over at offsets into that layout (the padding between parameters
        does not cross). The copy waits for the compute issued before this call and for
        what d2h itself issues there (flattening a non-contiguous tensor); `after`: a
        marker it must also wait for. The caller hands the transfer back with
        `release_host` once consumed (once: a second release is ignored). `abort` is
        called while waiting for a free host buffer and raises to give up (the consumer
        of those buffers has failed). `dtype`: cross in this dtype, converted on the
        device (a backend without a bus may hand over `src` as it is)."""
        raise NotImplementedError

    def host_pieces(self, t: Transfer) -> Iterator[tuple[int, torch.Tensor | list[torch.Tensor]]]:
        """A D2H transfer's data on a host thread, in order, each piece once it has landed:
        (element offset into the unit's flat gradient, a host tensor; or, on the CPU
        backend, at offset 0, what d2h was given). A piece's host memory may be reused
        once the consumer asks for the next one."""
        _wait_issued(t)
        yield 0, t.result

    def release_host(self, t: Transfer) -> None:
        pass

    def staging_bytes(self) -> int | None:  # the D2H staging pool's (None: no pool)
        return None

    def d2h_into(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Transfer | None:
        """Copy each device tensor straight into its host destination, contiguous and
        page-locked (no staging pool, no host copy after: half the host memory traffic),
        after the work issued so far on the current stream; the transfer's `cuda_event`
        marks them done (`wait_host`). None where the backend cannot (the caller stages)."""
        return None

    def wait_host(self, t: Transfer) -> None:
        """The calling host thread waits until `d2h_into`'s copies have landed."""
        _wait_issued(t)

    def offload(self, t: torch.Tensor) -> torch.Tensor:
        """Move an activation to host memory (activation offload); `fetch` brings it back."""
        return t

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reclaim(self, t: torch.Tensor) -> None:
        """An offloaded activation that will never be fetched (an abandoned step): its host
        buffer goes back to the pool rather than being freed under a pending copy."""

    def wait_compute(self, t: Transfer) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        pass

    def peak_allocated(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class CpuBackend(Backend):
    """The 'device' is host memory. By default (`helper_threads=False`) a unit's H2D copy
    is a memcpy run on the computing thread when the compute first needs the unit, and
    the engine runs its host work there too (`inline`). `helper_threads=True` copies on a
    thread of its own and leaves the engine its host worker thread: slower on the CPU, it
    lets tests exercise the concurrency the CUDA backend relies on."""

    name = "cpu"

    def __init__(self, helper_threads: bool = False) -> None:
        self.device = torch.device("cpu")
        self.inline = not helper_threads
        self._copier = None if self.inline else _CopyWorker("atom-h2d")
        keep_freed_blocks()  # per-visit gradients would page-fault in again every step

    def alloc_device(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def record(self) -> object:
        # Compute on CPU is synchronous in the calling thread: once it returns, it is done.
        return None

    def h2d(self, dst, src, after, host_ready, locks=()) -> Transfer:
        t = Transfer()

        def job() -> None:
            if self.inline and not all(ev.is_set() for ev in host_ready):
                # only this thread could release the unit, and it is here: a wait would
                # never end (an engine bug, said at once rather than after 10 minutes)
                raise RuntimeError("a unit was loaded before its host update ran")
            t.ready_wait_s = _wait_events(host_ready)
            with _held(locks):
                dst.copy_(src)

        if self.inline:  # run when the compute first needs it: the data is then hot
            t.job = job
            return t
        return self._copier.submit(job, t)

    def d2h(self, src, after=None, abort=None, dtype=None) -> Transfer:
        # The gradient already lives in host memory: hand the tensor(s) over, no copy (and
        # nothing to order: the compute that wrote it has returned).
        return done_transfer(src)

    def wait_compute(self, t: Transfer) -> None:
        job, t.job = t.job, None
        if job is not None:
            try:
                job()
            except Exception as err:  # as the copy thread reports it
                t.error = err
            finally:  # also when Ctrl+C cut it: the step is abandoned and its slot released
                t.issued.set()  # without this, that release waited 10 minutes
        _wait_issued(t)

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()


class CudaBackend(Backend):
    """Copy stream for H2D, one for D2H, and the current stream for compute.

    Host buffers are pinned so copies are true DMA and overlap compute. D2H lands in a
    pinned staging pool of one unit's gradient, cut in chunks: a gradient crosses chunk
    by chunk, the host consumer lands each chunk as its copy completes and hands it back,
    so the next unit's copy reuses it while the landing goes on (`host_pieces`)."""

    name = "cuda"
    pins_host = True

    def __init__(
        self,
        device: torch.device,
        staging_numel: int = 0,  # or, before host memory is asked for, size_staging()
        staging_dtype: torch.dtype = torch.float32,
        staging_chunks: int = 8,
    ):
        if device.index is None:  # set_device and per-device stats need an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        torch.cuda.set_device(device)
        self.compute = torch.cuda.current_stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self.d2h_stream = torch.cuda.Stream(device)
        self.side = torch.cuda.Stream(device)  # the card update (side_stream)
        self._copier = _CopyWorker("atom-h2d")
        # Why a fixed pool: unbounded staging would let D2H run ahead of the host optimizer
        # and grow pinned memory without limit. Why one unit, in chunks: three whole
        # buffers of the largest unit in fp32 were 9.7 GB of the 21.6 GB pinned for a 7B.
        # Raw bytes: gradients come back in the compute dtype, or fp32 when several
        # micro-batches were summed on the device (the engine says which: size_staging).
        self._staging_item = torch.empty(0, dtype=staging_dtype).element_size()
        self._staging_chunks, self._staging_numel = staging_chunks, 0
        self._chunk_bytes = 0
        self.size_staging(staging_numel)
        self._staging: queue.Queue | None = None
        self._release_lock = threading.Lock()
        self._arenas: list = []
        self.pinned_bytes = 0
        # activation offload: pinned host buffers by (shape, dtype), reused every step
        self._offload_pool: dict[tuple, list[torch.Tensor]] = {}
        # tools/gpu_check: time each H2D copy with CUDA events (start, end, bytes)
        self.time_copies = False
        self._timed: list[tuple[object, object, int]] = []

    def size_staging(self, numel: int, dtype: torch.dtype | None = None) -> None:
        # a caller's larger size stays
        self._staging_numel = max(self._staging_numel, numel)
        if dtype is not None:
            self._staging_item = max(self._staging_item, torch.empty(0, dtype=dtype).element_size())
        total = self._staging_numel * self._staging_item
        # whole elements of any dtype that crosses, and 512-byte aligned for the DMA engine
        chunk = -(-total // self._staging_chunks)
        self._chunk_bytes = -(-chunk // 512) * 512
        self._staging_request = [(self._chunk_bytes, torch.uint8)] * self._staging_chunks

    def alloc_device(self, numel, dtype):
        return torch.empty(numel, dtype=dtype, device=self.device)

    def alloc_host(self, numel, dtype):
        return self.alloc_host_many([(numel, dtype)])[0]

    def alloc_host_many(self, requests):
        """One page-locked arena for the units' bus buffers and the D2H staging pool."""
        from atom.swap import pinned

        want_staging = self._staging is None
        arena, bufs = pinned.allocate(list(requests) + (self._staging_request * want_staging))
        if arena is not None:
            self._arenas.append(arena)
            self.pinned_bytes += arena.nbytes
        else:
            self.pinned_bytes += sum(b.nbytes for b in bufs)
        if want_staging:
            self._staging = queue.Queue()
            for buf in bufs[len(requests) :]:
                self._staging.put(buf)
        return bufs[: len(requests)]

    @staticmethod
    def _mark(stream) -> object:
        ev = torch.cuda.Event()  # waited for by streams only: no host thread blocks on it
        ev.record(stream)
        return ev

    def record(self) -> object:
        return self._mark(torch.cuda.current_stream(self.device))

    @contextmanager
    def side_stream(self):
        self.side.wait_event(self._mark(self.compute))  # e.g. the gradient it reads is done
        with torch.cuda.stream(self.side):
            yield

    def join_side(self) -> None:
        self.compute.wait_event(self._mark(self.side))

    def keep_for_side(self, t: torch.Tensor) -> None:
        t.record_stream(self.side)

    def h2d(self, dst, src, after, host_ready, locks=()) -> Transfer:
        t = Transfer()

        def job() -> None:
            t.ready_wait_s = _wait_events(host_ready)
            with _held(locks), torch.cuda.stream(self.h2d_stream):
                if after is not None:
                    self.h2d_stream.wait_event(after)  # slot's previous reader finished
                timed = self.time_copies
                if timed:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(self.h2d_stream)
                dst.copy_(src, non_blocking=True)
                # blocking: a host wait on it sleeps rather than spinning a core the host
                # optimizer's threads need (cudaEventBlockingSync)
                ev = torch.cuda.Event(enable_timing=timed, blocking=True)
                ev.record(self.h2d_stream)
                if timed:
                    self._timed.append((start, ev, src.nbytes))
                if locks:
                    ev.synchronize()  # the source must not change until the DMA has read it
            t.cuda_event = ev

        return self._copier.submit(job, t)

    def d2h(self, src, after=None, abort=None, dtype=None) -> Transfer:
        # a non-contiguous tensor is copied here, on the compute stream: the marker the
        # copy stream waits for is recorded after that copy, not before it
        srcs = [t.reshape(-1) for t in ([src] if isinstance(src, torch.Tensor) else src)]
        written = self.record()
        # where each source starts in the unit's flat layout: a list is a unit's
        # parameters, each at an aligned offset (atom/swap/units.py); gaps do not cross
        places, end = [], 0
        for s in srcs:
            places.append(end)
            end = aligned(end + s.numel())
        numel = sum(t.numel() for t in srcs)
        dtype = dtype or srcs[0].dtype
        item = torch.empty(0, dtype=dtype).element_size()
        if self._staging is None:  # no host buffers were asked for (profiler probes)
            self.alloc_host_many([])
        per = self._chunk_bytes // item  # elements per chunk
        if numel > per * self._staging_chunks:
            # waiting for chunks this very gradient would hold could never end
            raise RuntimeError(
                f"a {numel * item}-byte gradient does not fit the "
                f"{self._chunk_bytes * self._staging_chunks}-byte D2H staging pool: "
                "size_staging() was not told its size and dtype"
            )
        t = Transfer()
        try:
            for marker in (after, written):
                if marker is not None:
                    self.d2h_stream.wait_event(marker)
            start, which, within = 0, 0, 0  # next element; the source and place in it
            while start < numel:
                buf = self._free_staging(abort)  # the landing hands chunks back as it goes
                t.held.append(buf)
                n = min(per, numel - start)
                host = buf[: n * item].view(dtype)
                runs = []  # (offset in the unit's layout, the part of host it lands in)
                with torch.cuda.stream(self.d2h_stream):
                    done = 0
                    while done < n:  # a chunk may span several of the sources
                        take = min(n - done, srcs[which].numel() - within)
                        # another dtype: converted on the device (a chunk-sized temporary
                        # on this stream), then copied: torch does so when non_blocking
                        part = host[done : done + take]
                        part.copy_(srcs[which][within : within + take], non_blocking=True)
                        runs.append((places[which] + within, part))
                        done, within = done + take, within + take
                        if within == srcs[which].numel():
                            which, within = which + 1, 0
                    ev = torch.cuda.Event(blocking=True)  # the host worker sleeps on it
                    ev.record(self.d2h_stream)
                t.pieces.extend((offset, part, ev, buf) for offset, part in runs)
                start += n
        except BaseException:
            # the chunks' copies are queued on the D2H stream, in order: a later copy into
            # them, and its own event, come after these
            self.release_host(t)
            raise
        finally:
            # srcs were made on the compute stream; keep the allocator from reusing them early
            for s in srcs:
                s.record_stream(self.d2h_stream)
        t.issued.set()
        return t

    def staging_bytes(self) -> int | None:
        return self._chunk_bytes * self._staging_chunks

    def d2h_into(self, pairs):
        if not all(dst.is_contiguous() and not dst.is_cuda for _, dst in pairs):
            return None
        t = Transfer()
        self.d2h_stream.wait_event(self.record())  # the sources are written
        with torch.cuda.stream(self.d2h_stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            t.cuda_event = torch.cuda.Event(blocking=True)  # the host worker sleeps on it
            t.cuda_event.record(self.d2h_stream)
        for src, _ in pairs:  # made on another stream: not reused before the copy is done
            src.record_stream(self.d2h_stream)
        t.issued.set()
        return t

    def wait_host(self, t: Transfer) -> None:
        _wait_issued(t)
        t.cuda_event.synchronize()

    def _free_staging(self, abort) -> torch.Tensor:
        """A free staging chunk. Their consumer is the host worker: when it has failed,
        `abort` raises its error at once instead of this waiting for chunks it holds."""
        waited = 0.0
        while True:
            try:
                return self._staging.get(timeout=0.5)
            except queue.Empty:
                waited += 0.5
            if abort is not None:
                abort()
            if waited >= 600:
                raise RuntimeError(
                    "no D2H staging chunk came back within 10 minutes: the host worker "
                    "that consumes them is stuck"
                )

    def host_pieces(self, t: Transfer):
        _wait_issued(t)
        for k, (offset, host, ev, buf) in enumerate(t.pieces):
            ev.synchronize()
            yield offset, host
            if k + 1 == len(t.pieces) or t.pieces[k + 1][3] is not buf:
                self._give_back(t, buf)  # its last piece consumed: the next copy may reuse it

    def _give_back(self, t: Transfer, buf) -> None:
        # the landing (host worker) and a cleanup path may both hand a transfer back
        with self._release_lock:
            for k, held in enumerate(t.held):
                if held is buf:
                    del t.held[k]
                    if self._staging is not None:  # None once closed
                        self._staging.put(buf)
                    return

    def release_host(self, t: Transfer) -> None:
        with self._release_lock:  # once: cleanup paths may release a landing again
            held, t.held = t.held, []
            if self._staging is not None:  # None once closed
                for buf in held:
                    self._staging.put(buf)

    def offload(self, t: torch.Tensor) -> torch.Tensor:
        """On the compute stream: ordered after the kernel that made `t` and before the
        `fetch` that reads it back, with no event bookkeeping. Into a pinned buffer of a
        pool kept across steps (page-locked once, counted in pinned_bytes; torch's
        caching host allocator would round each up to a power of two)."""
        from atom.swap import pinned

        free = self._offload_pool.setdefault((tuple(t.shape), t.dtype), [])
        if free:
            host = free.pop()
        else:
            arena, (flat,) = pinned.allocate([(t.numel(), t.dtype)])
            if arena is not None:
                self._arenas.append(arena)  # released by close(), not by a collection
            self.pinned_bytes += arena.nbytes if arena is not None else flat.nbytes
            host = flat.view(t.shape)
        host.copy_(t, non_blocking=True)
        return host

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to(self.device, non_blocking=True)
        self.reclaim(t)
        return out

    def reclaim(self, t: torch.Tensor) -> None:
        # Free for the next offload at once: its write is on the compute stream too, so
        # it runs after any read or write of this one already issued.
        self._offload_pool.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def wait_compute(self, t: Transfer) -> None:
        _wait_issued(t)
        torch.cuda.current_stream(self.device).wait_event(t.cuda_event)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def copy_gbps(self) -> float | None:
        """The timed H2D copies' own bandwidth: their bytes over the time they ran (not
        over the step: a compute-bound step leaves the bus idle by design)."""
        if not self._timed:
            return None
        self.synchronize()
        seconds = sum(start.elapsed_time(end) for start, end, _ in self._timed) / 1e3
        return sum(n for *_, n in self._timed) / max(seconds, 1e-9) / 1e9

    def peak_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def close(self) -> None:
        """Release the page-locked memory now, not at a later garbage collection: a
        process that builds engine after engine (gpu_check, benchmarks) must not pin the
        sum of them. The host store's buffers stay valid as ordinary (pageable) memory."""
        self._copier.close()
        try:
            self.synchronize()  # no copy may still be reading or writing what goes
        except Exception:  # a CUDA error that ended the run: the memory goes anyway
            log.exception("synchronize before releasing pinned memory failed")
        for arena in self._arenas:
            arena.release()
        self._arenas.clear()
        self._staging = None
        self._offload_pool.clear()
        self.pinned_bytes = 0
