"""LLaMA style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from atom.config import ModelConfig
from atom.model.common import LanguageModel
from atom.model.kv_cache import LayerCache, attention_mask
from atom.model.sdpa import attention

_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def inv_frequencies(dim: int, theta: float, scaling: tuple = ("default",), device=None):
    """RoPE's inverse frequencies, with Hugging Face's frequency scalings: `scaling` is
    ("default",), ("linear", factor), ("llama3", factor, low, high, original_context) or
    ("yarn", factor, original_context, beta_fast, beta_slow, attention_factor, truncate)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    kind = scaling[0]
    if kind == "yarn":  # YaRN (arXiv 2309.00071), as transformers computes it
        factor, context, beta_fast, beta_slow, _, truncate = scaling[1:]

        def dimension(rotations: float) -> float:  # where a frequency turns that many times
            return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dimension(beta_fast), dimension(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        i = torch.arange(dim // 2, device=device, dtype=torch.float32)
        keep = 1 - ((i - low) / (high - low)).clamp(0, 1)  # 1: high frequencies, kept
        return (1.0 / (factor * pos_freqs)) * (1 - keep) + inv * keep
    if kind == "linear":
        return inv / scaling[1]
    if kind == "llama3":  # Llama 3.1: scale the long wavelengths, keep the short, ramp between
        factor, low, high, context = scaling[1:]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > context / low, inv / factor, inv)
        smooth = (context / wavelen - low) / (high - low)
        ramp = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return torch.where(medium, ramp, scaled)
    return inv


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's cos/sin scale: the stated one, else 0.1 ln(factor) + 1 (the paper's)."""
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    return 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0


def rope_scaling(cfg: ModelConfig) -> tuple:
    if cfg.rope_type == "linear":
        return ("linear", cfg.rope_factor)
    if cfg.rope_type == "yarn":
        return ("yarn", cfg.rope_factor, cfg.rope_original_max_position, cfg.rope_beta_fast,
                cfg.rope_beta_slow, yarn_attention_factor(cfg), cfg.rope_truncate)  # fmt: skip
    if cfg.rope_type == "llama3":
        return ("llama3", cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                cfg.rope_original_max_position)  # fmt: skip
    return ("default",)


def rope_tables(
    T: int, dim: int, theta: float, device, dtype, scaling: tuple = ("default",)
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, dim/2), cached: computed in fp32 once per shape and device, not
    stored as buffers, so blocks stay parameter-only and swap without extra state."""
    key = (T, dim, theta, scaling, str(device), dtype)
    if key not in _ROPE_CACHE:
        inv = inv_frequencies(dim, theta, scaling, device)
        freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)
        scale = scaling[5] if scaling[0] == "yarn" else 1.0  # YaRN's attention factor
        _ROPE_CACHE[key] = ((freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype))
    return _ROPE_CACHE[key]


_WINDOW_CACHE: dict[tuple, torch.Tensor] = {}


def window_mask(T: int, window: int, device) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j: j <= i and j > i - window (the
    Hugging Face sliding-window rule). Cached per shape and device."""
    key = (T, window, str(device))
    if key not in _WINDOW_CACHE:
        i = torch.arange(T, device=device)
        _WINDOW_CACHE[key] = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return _WINDOW_CACHE[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hs); rotate the pairs (x[i], x[i + hs/2]) ("rotate half", the layout
    # Hugging Face LLaMA/Mistral/Qwen2 checkpoints use, so they load without permuting).
    half = x.size(-1) // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32: bf16 mean-of-squares underflows
        y = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        return y.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hs = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.scaling = rope_scaling(cfg)
        self.window = cfg.sliding_window
        self.context = cfg.seq_len
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.hs, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.hs, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.hs, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_head * self.hs, cfg.d_model, bias=False)

    def forward(self, x, kv: LayerCache | None = None, start: int = 0, docs=None):
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.hs).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)
        # generation (start > 0) slices one table of the context length: a table per
        # decoded length would fill the cache
        length = T if start == 0 else max(start + T, self.context)
        cos, sin = rope_tables(length, self.hs, self.theta, x.device, x.dtype, self.scaling)
        if docs is not None:  # packed documents: each counts its positions from 0
            cos, sin = docs.gather(cos), docs.gather(sin)
        else:
            cos, sin = cos[start : start + T], sin[start : start + T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # grouped-query heads (n_kv < n_head) are expanded only where a mask is passed
        if docs is not None:  # and sees only itself (within the window when there is one)
            window = self.window if self.window is not None and self.window < T else None
            y = docs.attend(q, k, v, window)
        elif kv is not None:  # generation: attend to every cached key the rules allow
            k, v = kv.append(k, v)
            y = attention(q, k, v, mask=attention_mask(start, T, self.window, x.device))
        elif self.window is not None and self.window < T:  # the window cuts in: a band mask
            y = attention(q, k, v, mask=window_mask(T, self.window, x.device))
        else:
            y = attention(q, k, v, causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, kv: LayerCache | None = None, start: int = 0, docs=None):
        x = x + self.attention(self.attention_norm(x), kv, start, docs)
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaEmbed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, idx: torch.Tensor, start: int = 0, docs=None) -> torch.Tensor:
        return self.wte(idx)  # positions enter through RoPE in attention


class LlamaHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def build_llama(cfg: ModelConfig) -> LanguageModel:
    model = LanguageModel(
        cfg, LlamaEmbed(cfg), [LlamaBlock(cfg) for _ in range(cfg.n_layer)], LlamaHead(cfg)
    )
    if cfg.tied:
        model.head.lm_head.weight = model.embed.wte.weight
    return model
