"""GPT-2 / GPT-3 style decoder: learned positions, pre-LayerNorm, GELU MLP, tied head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.config import ModelConfig
from atom.model.common import LanguageModel
from atom.model.documents import Documents
from atom.model.kv_cache import LayerCache, attention_mask


class GPTEmbed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, start: int = 0, docs: Documents | None = None):
        if docs is not None:  # each packed document counts from 0
            return self.wte(idx) + self.wpe(docs.positions)
        pos = torch.arange(start, start + idx.size(1), device=idx.device)
        return self.wte(idx) + self.wpe(pos)  # (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x, kv: LayerCache | None = None, start: int = 0, docs=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv is not None:  # generation: attend to the cached keys too
            k, v = kv.append(k, v)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask(start, T, None, x.device)
            )
        elif docs is not None:  # packed documents: each sees only itself
            y = docs.attend(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.approximate = cfg.gelu  # "none" (exact erf) or "tanh" (GPT-2's gelu_new)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, kv: LayerCache | None = None, start: int = 0, docs=None):
        x = x + self.attn(self.ln_1(x), kv, start, docs)
        return x + self.mlp(self.ln_2(x))


class GPTHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # (B, T, V)


def build_gpt(cfg: ModelConfig) -> LanguageModel:
    model = LanguageModel(
        cfg, GPTEmbed(cfg), [GPTBlock(cfg) for _ in range(cfg.n_layer)], GPTHead(cfg)
    )
    if cfg.tied:
        model.head.lm_head.weight = model.embed.wte.weight
    return model
