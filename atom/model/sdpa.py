"""Scaled dot-product attention on a fused kernel, with grouped-query heads and masks.

SDPA picks its kernel per call: flash attention takes grouped-query heads (`enable_gqa`)
but no mask; memory-efficient attention takes a mask but not `enable_gqa`. A masked call
with fewer key/value heads than query heads (packed documents, a sliding window shorter
than the sequence, generation with a cache) fits neither and runs on the math kernel,
which keeps fp32 scores and repeated K/V for the backward: slower, and more device memory
than the plan predicts. So a masked call gets its K/V heads repeated here (what
`enable_gqa` means: query head h reads K/V head h // (n_head / n_kv)) and runs on the
memory-efficient kernel; an unmasked causal call keeps GQA for flash.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """(B, heads, T, hs) queries over (B, kv_heads, S, hs) keys and values; `mask` (bool,
    True = may attend, broadcasting to (B, heads, T, S)) or `causal`, not both."""
    if mask is not None:
        k, v = expand_kv(q, k, v)
    gqa = k.size(1) != q.size(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """K/V with as many heads as `q` (query head h reads K/V head h // (heads / kv_heads),
    as `enable_gqa` does); unchanged when they already have as many."""
    if k.size(1) == q.size(1):
        return k, v
    repeat = q.size(1) // k.size(1)
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
