"""One pinned host arena per process, sliced into the buffers that cross the bus.

Why not `torch.empty(..., pin_memory=True)` per unit: those go through torch's caching
host allocator, which rounds every block up to a power of two (a 2.7B model's 5.6 GB of
units took ~9.1 GB of pinned memory), and pinned pages cannot be swapped out: host RAM is
the user's binding limit. Here one ordinary allocation is page-locked with
cudaHostRegister, so the pinned bytes are the buffers' bytes (plus alignment), and the
CUDA backend reports them.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

log = logging.getLogger(__name__)

ALIGN = 4096  # page: DMA-friendly, and any dtype's view of a slice is aligned


def page_aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Registration:
    """One cudaHostRegister, undone once: by `PinnedArena.release` or when the memory goes.
    Twice would fail and leave CUDA's last-error set for torch to raise at a later launch.
    Holds the address only, never the memory (a finalizer that kept it would never run)."""

    def __init__(self, ptr: int) -> None:
        self.ptr: int | None = ptr

    def undo(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr is None:
            return
        try:
            err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        except Exception:  # interpreter shutdown: CUDA may already be gone
            return
        if err != 0:  # leaves CUDA's last error set: torch would raise it at a later launch
            log.warning("cudaHostUnregister failed (error %d)", err)
            _consume_cuda_error()


def _consume_cuda_error() -> None:
    """A failed cudaHostRegister leaves CUDA's last-error set, and torch would raise it at
    the next kernel launch (seen on the H100 machine); one tiny launch reads and clears it."""
    try:
        torch.empty(1, device="cuda").fill_(0)
    except Exception:
        pass


class PinnedArena:
    """Slices of one page-locked allocation. `slices[i]` has `requests[i]`'s numel/dtype.

    The memory is a numpy array that every slice keeps alive; it is unregistered by
    `release()` (an engine's close) or else when the last slice goes (weakref.finalize
    runs before numpy frees it), so a later arena that gets the same addresses can register
    them again. After release the slices are still valid, as ordinary pageable memory."""

    def __init__(self, requests: list[tuple[int, torch.dtype]]):
        sizes = [n * torch.empty(0, dtype=dt).element_size() for n, dt in requests]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += page_aligned(max(size, 1))
        self.nbytes = total
        # over-allocate by a page to start the registered region on a page boundary
        raw = np.empty(total + ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        self.buffer = torch.from_numpy(raw)[start : start + total]
        self._register(self.buffer)
        self._registration = _Registration(self.buffer.data_ptr())
        weakref.finalize(raw, self._registration.undo)
        self.slices = [
            self.buffer[o : o + size].view(dt)[:n]
            for o, size, (n, dt) in zip(offsets, sizes, requests, strict=True)
        ]

    def release(self) -> None:
        """Unlock the pages now (no copy may be using them: the caller synchronized)."""
        self._registration.undo()

    @staticmethod
    def _register(buf: torch.Tensor) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
        if err != 0:
            _consume_cuda_error()
            raise RuntimeError(
                f"cudaHostRegister of {buf.numel() / 2**30:.2f} GiB failed (error {err}): "
                "the system refused to page-lock that much host memory"
            )


_warned = False


def allocate(requests: list[tuple[int, torch.dtype]]) -> tuple[PinnedArena | None, list]:
    """An arena for `requests`, or (None, per-buffer pinned tensors from torch's allocator)
    where page-locking an ordinary allocation is refused."""
    try:
        arena = PinnedArena(requests)
        return arena, arena.slices
    except (RuntimeError, AttributeError) as err:
        global _warned
        say = log.debug if _warned else log.warning  # once: offload buffers come by the dozen
        _warned = True
        say("one pinned arena failed (%s); pinning buffer by buffer instead", err)
        return None, [torch.empty(n, dtype=dt, pin_memory=True) for n, dt in requests]
