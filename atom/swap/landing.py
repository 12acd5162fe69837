"""A unit's gradient arriving on the host: what crosses, and how it lands.

The host worker copies (first run of a step) or adds (later runs, micro-batch-major) a
D2H transfer into the unit's host gradient, piece by piece as each piece lands: on CUDA
each piece is a chunk of the pinned staging pool, handed back as soon as it is landed so
the next unit's copy reuses it (atom/swap/backend.py).
"""

from __future__ import annotations

import torch

from atom.swap.backend import Backend, Transfer
from atom.swap.host_store import HostStore

# fp32 elements of the mixed-dtype landing's scratch: 1 MiB, a core's L2 on current CPUs,
# so a slice converted into it is still in cache when the add reads it
SCRATCH_ELEMENTS = 1 << 18


def crossing_dtype(grad: torch.dtype, compact: bool) -> torch.dtype:
    """The dtype a gradient crosses in: as computed, except fp32 sums of several
    micro-batches in compact state, which cross rounded to the host gradient's bf16 (half
    the bytes; rounded on the device, as the landing would have rounded them)."""
    return torch.bfloat16 if compact and grad == torch.float32 else grad


class GradientLanding:
    """Lands D2H transfers into each unit's host gradient (flat, `grads[u]`; `params[u]`:
    the unit's parameters, each with offset, numel and shape). Only the host worker thread
    calls `land`, one landing at a time (its fp32 scratch is shared)."""

    def __init__(self, backend: Backend, grads: list[torch.Tensor], params: list[list]):
        self.backend, self.grads = backend, grads
        self._scratch: torch.Tensor | None = None  # fp32, for mixed-dtype landings
        # per-parameter views of each unit's host gradient, in unit.params order; none for
        # a unit updated on the device, whose host gradient is empty (it never lands here)
        self._views = [
            [grad[p.offset : p.offset + p.numel].view(p.shape) for p in ps] if grad.numel() else []
            for grad, ps in zip(grads, params, strict=True)
        ]

    @classmethod
    def of(cls, backend: Backend, store: HostStore) -> GradientLanding:
        return cls(backend, [b.grad for b in store.buffers], [b.spec.params for b in store.buffers])

    def land(self, u: int, transfer: Transfer, first: bool) -> None:
        grad = self.grads[u]
        for offset, host in self.backend.host_pieces(transfer):
            if isinstance(host, torch.Tensor):
                dst, src = [grad[offset : offset + host.numel()]], [host]
            else:
                dst, src = self._views[u], host
            if first:
                torch._foreach_copy_(dst, src)
            elif src[0].dtype == dst[0].dtype:
                torch._foreach_add_(dst, src)
            else:
                self._add_widened(dst, src)
        self.backend.release_host(transfer)

    def _add_widened(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """dst (fp32) += src (bf16). torch's mixed-dtype add measured ~4x slower than a
        conversion into fp32 scratch followed by an add; a scratch as large as the unit
        sends both passes through DRAM (18 bytes an element), so the conversion goes a
        cache-sized slice at a time and the add reads it back from cache (10 bytes)."""
        if self._scratch is None:
            self._scratch = torch.empty(SCRATCH_ELEMENTS)
        for d, s in zip(dst, src, strict=True):
            d, s = d.view(-1), s.view(-1)
            for k in range(0, s.numel(), SCRATCH_ELEMENTS):
                piece = s[k : k + SCRATCH_ELEMENTS]
                scratch = self._scratch[: piece.numel()]
                scratch.copy_(piece)
                d[k : k + piece.numel()].add_(scratch)
