"""One optimizer per unit, over the unit's state in the host store: torch's AdamW (fp32
state), CompactAdamW (compact) or Bf16AdamW (bf16), the first decayed parameters first.
The moments of units updated on the device cross the bus every step, so they are
page-locked, in one arena.
"""

from __future__ import annotations

import torch

from atom.config import Config
from atom.optim import TorchUnitOptimizer
from atom.optim.bf16 import Bf16AdamW, Bf16Scratch
from atom.optim.compact import BLOCK, CHUNK, ChunkScratch, CompactAdamW, padded
from atom.optim.compact_kernel import CompiledChunkUpdate
from atom.swap.backend import Backend
from atom.swap.host_store import HostStore


def unit_optimizers(
    cfg: Config, store: HostStore, backend: Backend, card: set[int]
) -> list[TorchUnitOptimizer | CompactAdamW | Bf16AdamW]:
    """One optimizer per unit, over its flat master (decayed parameters first)."""
    train, bufs, paged = cfg.train, store.buffers, store.paged
    moments = _card_moments(store, backend, card)
    if store.bf16:
        scratch = Bf16Scratch(max(b.spec.n_owned for b in bufs))
        return [
            Bf16AdamW(
                b.master,
                b.grad,
                b.spec.n_owned,
                b.spec.n_decay,
                b.spec.index,
                train,
                scratch,
                paged,
                moments.get(b.spec.index),
            )  # fmt: skip
            for b in bufs
        ]
    if not store.compact:
        return [
            TorchUnitOptimizer(
                b.master,
                b.grad,
                b.spec.n_owned,
                b.spec.n_decay,
                train,
                paged,
                moments.get(b.spec.index),
            )  # fmt: skip
            for b in bufs
        ]
    scratch = ChunkScratch(max(b.spec.n_owned for b in bufs))
    fused = CompiledChunkUpdate(train.beta1, train.beta2) if cfg.swap.compile_update else None
    if fused is not None and any(b.spec.n_owned >= CHUNK and b.spec.index not in card
                                 for b in bufs):  # fmt: skip
        fused.prepare(CHUNK)  # here, on the training thread, not in the first step
    return [
        CompactAdamW(
            b.master,
            b.rem,
            b.grad,
            b.spec.n_owned,
            b.spec.n_decay,
            train,
            scratch,
            paged,
            fused,
            moments.get(b.spec.index),
        )  # fmt: skip
        for b in bufs
    ]


def _card_moments(
    store: HostStore, backend: Backend, card: set[int]
) -> dict[int, tuple[torch.Tensor, ...]]:
    """Page-locked moment buffers for the units updated on the device."""
    if not card:
        return {}

    def per(n: int) -> list[tuple[int, torch.dtype]]:
        if store.master_dtype == torch.float32:
            return [(n, torch.float32)] * 2
        return [(padded(n), torch.uint8)] * 2 + [(padded(n) // BLOCK, torch.float32)] * 2

    order = sorted(card)
    shapes = [per(store.buffers[u].spec.n_owned) for u in order]
    flat = iter(backend.alloc_host_many([r for rs in shapes for r in rs]))
    return {u: tuple(next(flat) for _ in rs) for u, rs in zip(order, shapes, strict=True)}
