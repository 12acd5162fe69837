"""Model pieces against straightforward reference computations.

pytest tests/test_model.py
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from atom.config import ModelConfig
from atom.model import build_model, materialize
from atom.model.llama import apply_rope, rope_tables


def naive_attention(q, k, v):
    """Explicit causal softmax attention, (B, nh, T, hs)."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return F.softmax(att, dim=-1) @ v


def test_gpt_block_matches_explicit_math():
    cfg = ModelConfig(arch="gpt", n_layer=1, n_head=4, d_model=32, seq_len=16, bias=True)
    model = materialize(build_model(cfg), seed=3)
    block = model.blocks[0]
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        h = F.layer_norm(x, (32,), block.ln_1.weight, block.ln_1.bias)
        q, k, v = (h @ block.attn.c_attn.weight.T + block.attn.c_attn.bias).split(32, dim=2)
        q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in (q, k, v))
        y = naive_attention(q, k, v).transpose(1, 2).reshape(2, 16, 32)
        x1 = x + y @ block.attn.c_proj.weight.T + block.attn.c_proj.bias
        h2 = F.layer_norm(x1, (32,), block.ln_2.weight, block.ln_2.bias)
        m = F.gelu(h2 @ block.mlp.c_fc.weight.T + block.mlp.c_fc.bias)
        expected = x1 + m @ block.mlp.c_proj.weight.T + block.mlp.c_proj.bias
        torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_gpt_head_is_tied_to_the_embedding():
    model = materialize(build_model(ModelConfig(arch="gpt")), seed=0)
    assert model.head.lm_head.weight is model.embed.wte.weight
    assert "head.lm_head.weight" not in dict(model.named_parameters())


def test_llama_gqa_matches_repeated_kv_heads():
    cfg = ModelConfig(arch="llama", n_layer=1, n_head=4, n_kv_head=2, d_model=32, seq_len=16)
    model = materialize(build_model(cfg), seed=5)
    attn = model.blocks[0].attention
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        q = (x @ attn.wq.weight.T).view(2, 16, 4, 8).transpose(1, 2)
        k = (x @ attn.wk.weight.T).view(2, 16, 2, 8).transpose(1, 2)
        v = (x @ attn.wv.weight.T).view(2, 16, 2, 8).transpose(1, 2)
        cos, sin = rope_tables(16, 8, cfg.rope_theta, x.device, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        y = naive_attention(q, k, v).transpose(1, 2).reshape(2, 16, 32) @ attn.wo.weight.T
        torch.testing.assert_close(attn(x), y, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(32, 8, 10000.0, "cpu", torch.float32)
    q, k = torch.randn(8), torch.randn(8)

    def score(i, j):
        qi = apply_rope(q.view(1, 1, 1, 8).expand(1, 1, 32, 8), cos, sin)[0, 0, i]
        kj = apply_rope(k.view(1, 1, 1, 8).expand(1, 1, 32, 8), cos, sin)[0, 0, j]
        return float(qi @ kj)

    assert abs(score(5, 2) - score(20, 17)) < 1e-4
    assert abs(score(3, 3) - float(q @ k)) < 1e-4  # no rotation between equal positions
    assert abs(score(5, 2) - score(5, 4)) > 1e-4  # and it does depend on the offset
    rotated = apply_rope(q.view(1, 1, 1, 8).expand(1, 1, 32, 8), cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm().expand(1, 1, 32))


def test_rmsnorm_matches_formula():
    cfg = ModelConfig(arch="llama", n_layer=1, n_head=2, d_model=16)
    norm = materialize(build_model(cfg), seed=0).head.norm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(3, 16)
        expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * norm.weight
        torch.testing.assert_close(norm(x), expected)


def test_init_depends_only_on_seed_and_name():
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, d_model=16)
    a = dict(materialize(build_model(cfg), seed=1).named_parameters())
    b = dict(materialize(build_model(cfg), seed=1).named_parameters())
    c = dict(materialize(build_model(cfg), seed=2).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["blocks.0.attention.wq.weight"], c["blocks.0.attention.wq.weight"])
    assert not torch.equal(a["blocks.0.attention.wq.weight"], a["blocks.1.attention.wq.weight"])
    # residual projections start smaller (GPT-2 scaling by 1/sqrt(2 * n_layer))
    assert a["blocks.0.attention.wo.weight"].std() < a["blocks.0.attention.wq.weight"].std()
