"""What every atom model shares: embed -> blocks -> head, and name-keyed initialisation.

A model is three kinds of pieces so the swap engine can cut it into units without
knowing the architecture: `embed(idx) -> h`, each `blocks[i](h) -> h`, `head(h) -> logits`.
Initialisation is a pure function of (seed, parameter name), so a model materialised
all at once (resident) and one materialised unit by unit into host buffers (swapped)
start from bit-identical weights.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from atom.config import ModelConfig
from atom.model.documents import IGNORE, Documents


class LanguageModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, embed: nn.Module, blocks: list[nn.Module], head: nn.Module
    ):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache=None,
        docs: Documents | None = None,
    ):
        """`cache` (atom.model.kv_cache.KVCache): generation, idx continues the cached
        tokens; the cache takes the new keys/values and advances. `docs`: rows packed with
        several documents, kept apart (atom.model.documents)."""
        if cache is None:
            h = self.embed(idx, docs=docs)  # (B, T, C)
            for block in self.blocks:
                h = block(h, docs=docs)
        else:
            start = cache.pos
            h = self.embed(idx, start)
            for block, kv in zip(self.blocks, cache.layers, strict=True):
                h = block(h, kv, start)
            cache.pos += idx.size(1)
        logits = self.head(h)  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets that count: IGNORE (-100) marks a token with no
    loss (a prompt's, a padding's). A batch with none at all gives 0, not 0/0 = NaN, and
    no host sync is needed to find out."""
    # fp32 softmax: bf16 logits lose too much precision in the log-sum-exp.
    flat = targets.view(-1)
    total = F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), flat, ignore_index=IGNORE, reduction="sum"
    )
    return total / (flat != IGNORE).sum().clamp(min=1)


def _param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


# Parameters whose init is scaled by 1/sqrt(2 * n_layer): the projections that write into
# the residual stream (GPT-2 paper, section 2.3), so the stream's variance stays bounded.
_RESIDUAL_PROJ = (
    "attn.c_proj.weight",
    "mlp.c_proj.weight",
    "attention.wo.weight",
    "feed_forward.w2.weight",
)


@torch.no_grad()
def init_parameter(name: str, param: torch.Tensor, cfg: ModelConfig, seed: int) -> None:
    """Initialise one parameter in place from (seed, name) alone."""
    leaf = name.rsplit(".", 1)[-1]
    if param.dim() == 1:
        # norms start at identity, biases at zero
        param.fill_(0.0 if leaf == "bias" else 1.0)
        return
    std = cfg.init_std
    if name.endswith(_RESIDUAL_PROJ):
        std = std / math.sqrt(2 * cfg.n_layer)
    gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
    # Sample on the CPU in fp32 so every device and dtype gets the same numbers.
    values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    param.copy_(values)


def materialize(
    model: nn.Module,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Allocate a meta-built model on `device` and initialise it by name."""
    model.to_empty(device=device)
    model.to(dtype)
    cfg = model.cfg
    if cfg.tied:
        model.head.lm_head.weight = model.embed.wte.weight
    for name, param in model.named_parameters():
        init_parameter(name, param, cfg, seed)
    return model
