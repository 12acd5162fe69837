"""Model analysis without allocating: parameters, bytes and activation memory per unit.

The model is built on the meta device, so a 7B model costs nothing to analyse. Activation
bytes are analytic: what autograd saves for one block per token, derived from the ops in
atom/model (and checked against a measured block in tests/test_profiler.py):

  GPT block    7d + 2f + h + 4 elements per token
               (LN stats 2+2, LN outputs 2d, fused qkv 3d, attention out d, the residual
               sum d, MLP in/out 2f, attention log-sum-exp h)
  LLaMA block  8d + 2kv + h + 4f + 2 elements per token
               (RMSNorm normed + scaled 2x2d, residual d, rotated q d, k and v 2kv,
               attention out + its contiguous copy 2d, SwiGLU 4f, lse h, rstd 2)

where d = d_model, f = MLP width, h = heads, kv = kv_heads * head_dim. Small fp32 stats are
counted in the compute dtype; the error is well under the 10% the memory model promises.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from atom.config import Config, ModelConfig
from atom.model import build_model
from atom.swap.units import partition


@dataclass(frozen=True)
class UnitInfo:
    index: int
    kind: str  # embed | blocks | head
    n_blocks: int
    n_owned: int  # parameters whose master/optimizer state this unit holds
    n_total: int  # parameters that cross the bus (owned + tied aliases)
    tied: bool = False  # shares tied weights with another unit: its update stays on the host


@functools.cache
def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def block_activation_elements_per_token(m: ModelConfig) -> int:
    d, f, h = m.d_model, m.ffn_dim, m.n_head
    if m.arch == "gpt":
        return 7 * d + 2 * f + h + 4
    kv = m.kv_heads * m.head_dim
    return 8 * d + 2 * kv + h + 4 * f + 2


def head_activation_bytes(m: ModelConfig, tokens: int, dt: int) -> int:
    """The head's saved tensors: its input, norm output(s), one fp32 log-sum-exp and an
    int64 target per token (atom/model/head_loss.py: the logits are never whole), and one
    chunk's logits in fp32 and the compute dtype while the forward makes them."""
    from atom.model.head_loss import chunk_tokens

    norm_elems = 2 * m.d_model + 2 if m.arch == "gpt" else 3 * m.d_model + 1
    chunk = min(tokens, chunk_tokens(m.vocab_size)) * m.vocab_size * (4 + dt)
    return tokens * (norm_elems * dt + 4 + 8) + chunk


def head_workspace_bytes(m: ModelConfig, tokens: int, dt: int) -> int:
    """Transients of the head's backward that autograd does not save: one chunk's logits
    recomputed (compute dtype), their fp32 gradient and its compute-dtype copy."""
    from atom.model.head_loss import chunk_tokens

    return min(tokens, chunk_tokens(m.vocab_size)) * m.vocab_size * (dt + 4 + dt)


@dataclass
class ModelAnalysis:
    cfg: Config
    units: list[UnitInfo]
    n_params: int
    _records: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, cfg: Config) -> ModelAnalysis:
        from atom.swap.card_update import eligible

        model = build_model(cfg.model, device="meta")
        specs = partition(model, cfg.swap.layers_per_unit)
        units = [
            UnitInfo(
                s.index,
                s.kind,
                len(s.module.parts) if s.kind == "blocks" else 0,
                s.n_owned,
                s.n_total,
                not eligible(specs, s.index),
            )
            for s in specs
        ]
        return cls(cfg, units, sum(u.n_owned for u in units))

    # (cached: the planner asks for these for every placement it weighs)
    @functools.cached_property
    def largest_unit(self) -> int:
        return max(u.n_total for u in self.units)

    @functools.cached_property
    def largest_block_unit(self) -> int:
        return max(u.n_total for u in self.units if u.kind == "blocks")

    @functools.cached_property
    def most_blocks(self) -> int:
        """Blocks in the largest unit (layers_per_unit, or fewer for a short model)."""
        return max(u.n_blocks for u in self.units)

    def unit_bytes(self, dtype: torch.dtype) -> list[int]:
        return [u.n_total * dtype_bytes(dtype) for u in self.units]

    def block_params(self) -> int:
        blocks = [u for u in self.units if u.kind == "blocks"]
        return blocks[0].n_owned // blocks[0].n_blocks

    def block_activation_bytes(self, micro_batch: int, dtype: torch.dtype) -> int:
        tokens = micro_batch * self.cfg.model.seq_len
        return tokens * block_activation_elements_per_token(self.cfg.model) * dtype_bytes(dtype)

    def hidden_bytes(self, micro_batch: int, dtype: torch.dtype) -> int:
        """One (B, T, d) activation: a unit input / checkpoint."""
        return micro_batch * self.cfg.model.seq_len * self.cfg.model.d_model * dtype_bytes(dtype)

    def head_activation_bytes(self, micro_batch: int, dtype: torch.dtype) -> int:
        return head_activation_bytes(
            self.cfg.model, micro_batch * self.cfg.model.seq_len, dtype_bytes(dtype)
        )

    def head_workspace_bytes(self, micro_batch: int, dtype: torch.dtype) -> int:
        return head_workspace_bytes(
            self.cfg.model, micro_batch * self.cfg.model.seq_len, dtype_bytes(dtype)
        )

    def record_bytes(self, state: str) -> list[int]:
        """Per unit, the cold state the NVMe tier keeps on disk (master and moments; in
        compact state also the remainder and block scales), 4 KiB-aligned regions."""
        # asked for every plan the planner prices: once per state (a list not to change)
        if state not in self._records:
            self._records[state] = self._record_bytes(state)
        return self._records[state]

    def _record_bytes(self, state: str) -> list[int]:
        from atom.optim.compact import BLOCK, padded
        from atom.swap.disk_tier import ALIGN

        def aligned(n: int) -> int:
            return -(-n // ALIGN) * ALIGN

        out = []
        for u in self.units:
            n = u.n_owned
            scales = 4 * padded(n) // BLOCK
            if state == "compact":  # master, comp, two code arrays, two scale arrays
                parts = [2 * n, 2 * n, padded(n), padded(n), scales, scales]
            elif state == "bf16":  # the weights, two code arrays, two scale arrays
                parts = [2 * n, padded(n), padded(n), scales, scales]
            else:
                parts = [4 * n] * 3
            out.append(max(ALIGN, sum(aligned(p) for p in parts)))
        return out

    def host_bytes(
        self,
        dtype: torch.dtype,
        state: str = "fp32",
        disk: bool = False,
        disk_slots: int = 3,
        card: frozenset[int] = frozenset(),
        kept: frozenset[int] = frozenset(),
    ) -> int:
        """Host RAM for model state, as atom/swap/host_store.py allocates it.

        fp32 (swap.state): master, gradient and two Adam moments, 16 bytes per parameter.
        compact: bf16 master + int16 remainder + bf16 gradient + two 8-bit moments
        with an fp32 scale per block, ~8 bytes, and a few chunks of fp32 scratch.
        Plus, per unit, the compute-dtype copy that crosses the bus, except where master is
        that copy (same dtype, no tied aliases), and the gradient of tied aliases.
        disk (swap.disk_dir): master and moments live on disk; RAM keeps the bus copy and
        the gradient of every unit, and `disk_slots` records of the largest unit.
        bf16 (the opt-in lossy state): bf16 weights (the bus copy), bf16 gradient, the
        8-bit moments; no fp32 master, no remainder: ~6 bytes.
        card: units updated on the device (swap.card_update), which have no host gradient
        (their gradient is summed on the device). kept: units whose weights live on the card
        alone (state_formats.weights_stay): no bus copy on the host, nor the bf16 master
        it is in compact and bf16 state."""
        from atom.optim.bf16 import SCRATCH_BYTES as BF16_SCRATCH_BYTES
        from atom.optim.compact import BLOCK, CHUNK, SCRATCH_BUFFERS, padded

        compact = state != "fp32"  # 8-bit moments, bf16 master and gradient, scratch
        master_dtype = torch.bfloat16 if compact else torch.float32
        # the host gradient is in the state's gradient dtype (host_store.py: master's)
        grads = sum(u.n_total for u in self.units if u.index not in card) * dtype_bytes(
            master_dtype
        )
        largest = max(u.n_owned for u in self.units)
        # the update's chunk of temporaries (atom/optim/compact.py ChunkScratch, bf16.py's)
        per = {"fp32": 0, "compact": SCRATCH_BUFFERS * 4, "bf16": BF16_SCRATCH_BYTES}[state]
        scratch = per * min(CHUNK, padded(largest))
        if disk:  # a kept unit's slot is its compute copy (master stays in the record)
            copies = sum(u.n_total for u in self.units if u.index not in kept) * dtype_bytes(
                dtype
            )
            return int(
                grads + copies + scratch + max(2, disk_slots) * max(self.record_bytes(state))
            )
        moments = self.n_params * (2 + 8 / BLOCK) if compact else self.n_params * 8
        # fp32 master, or bf16 master + int16 remainder; bf16 state: the bf16 weights
        per_master = 2 if state == "bf16" else 4
        def same(u: UnitInfo) -> bool:  # master is the compute copy (host_store's rule)
            return dtype == master_dtype and u.n_total == u.n_owned

        # a kept unit: no compute copy on the host; where master is that copy and a bf16
        # one, no master either (host_store.kept_host_bytes)
        masters = sum(
            (per_master - 2 * compact * (u.index in kept and same(u))) * u.n_owned
            for u in self.units
        )
        copies = sum(
            u.n_total * dtype_bytes(dtype)
            for u in self.units
            if not same(u) and u.index not in kept
        )
        return int(masters + moments + grads + copies + scratch)

    def flops_per_token(self) -> dict[str, float]:
        """Forward FLOPs per token: 2 per parameter-multiply, plus causal attention."""
        m = self.cfg.model
        block = 2 * self.block_params() + 2 * m.seq_len * m.d_model  # QK^T and AV, causal half
        head = 2 * m.d_model * m.vocab_size
        return {"block": float(block), "head": float(head), "embed": 0.0}
