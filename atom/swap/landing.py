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
        self.backend, self.grads, self.params = backend, grads, params
        self._scratch: torch.Tensor | None = None  # host fp32, for mixed-dtype landings
        # per-parameter views of each unit's host gradient, in unit.params order
        self._views = [
            [grad[p.offset : p.offset + p.numel].view(p.shape) for p in ps]
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
                # torch's mixed-dtype add (bf16 into fp32) measured ~4x slower than a
                # conversion into fp32 scratch followed by an add
                scratch = self._scratch_like(u, src)
                torch._foreach_copy_(scratch, src)
                torch._foreach_add_(dst, scratch)
        self.backend.release_host(transfer)

    def _scratch_like(self, u: int, src: list[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 scratch laid out like `src`: one flat piece of a gradient, or unit u's
        parameters."""
        if self._scratch is None:
            self._scratch = torch.empty(max(g.numel() for g in self.grads))
        if len(src) == 1:
            return [self._scratch[: src[0].numel()].view(src[0].shape)]
        return [self._scratch[p.offset : p.offset + p.numel].view(p.shape) for p in self.params[u]]
