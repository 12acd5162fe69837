"""Packed documents are kept apart, and masked targets carry no loss and no gradient.

pytest tests/test_documents.py
"""

from __future__ import annotations

import pytest
import torch

from atom.model import build_model, lm_loss, materialize
from atom.model.documents import IGNORE, Documents, positions_in_documents
from atom.optim import lr_at
from atom.resident.engine import ResidentEngine
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_swap_equivalence import rel_err


def _model(**model):
    cfg = tiny_config(model=model)
    return materialize(build_model(cfg.model), seed=3).eval()


def _packed(lengths: list[int], vocab: int = 256, seed: int = 0):
    """One row of documents of the given lengths: (tokens, positions, starts)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    at = 0
    for n in lengths:
        starts[at] = True
        at += n
    positions = positions_in_documents(starts[None])
    return docs, torch.cat(docs)[None], positions


def test_positions_restart_at_each_document():
    starts = torch.tensor([[False, False, True, False, False, True], [True, True, False] * 2])
    assert positions_in_documents(starts).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize(
    "model",
    [
        {"arch": "gpt"},
        {"arch": "llama", "n_kv_head": 2},
        {"arch": "llama", "sliding_window": 5},  # the window cuts inside the documents
        {"arch": "llama", "rope_type": "linear", "rope_factor": 2.0},
    ],
)
def test_each_packed_document_reads_as_if_alone(model):
    """Logits of every document in a packed row equal those of the document on its own:
    positions restart and no token attends across a boundary."""
    net = _model(**model)
    docs, row, positions = _packed([7, 12, 13])
    with torch.no_grad():
        packed = net(row, docs=Documents(positions))[0][0]
        at = 0
        for doc in docs:
            alone = net(doc[None])[0][0]
            torch.testing.assert_close(packed[at : at + len(doc)], alone, rtol=1e-5, atol=1e-5)
            at += len(doc)
        # and without the documents the later ones do see the earlier: the test can fail
        mixed = net(row)[0][0]
    assert not torch.allclose(mixed[7:19], packed[7:19], atol=1e-3)


@pytest.mark.parametrize(
    "model",
    [{"arch": "gpt"}, {"arch": "llama", "n_kv_head": 2, "sliding_window": 11}],
    ids=["gpt", "llama-gqa-window"],
)
def test_chunked_attention_equals_the_whole_mask(model, monkeypatch):
    """Queries in chunks of 8, each against the keys from its earliest document start:
    the same logits as one masked call over the whole square, and later chunks skip the
    keys no query of theirs may see."""
    import atom.model.documents as documents

    net = _model(**model)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 256, (2, 32), generator=g)
    starts = torch.rand(2, 32, generator=g) < 0.2
    docs_whole = Documents(positions_in_documents(starts))
    with torch.no_grad():
        whole = net(x, docs=docs_whole)[0]
        monkeypatch.setattr(documents, "QUERY_CHUNK", 8)
        docs = Documents(positions_in_documents(starts))
        chunked = net(x, docs=docs)[0]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    blocks = docs.blocks()
    assert len(blocks) == 4 and any(lo > 0 for _, _, lo, _ in blocks)
    torch.testing.assert_close(docs.mask(), docs_whole.mask())


def test_one_document_per_row_is_plain_causal():
    net = _model(arch="llama", sliding_window=6)
    x = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(x, docs=Documents(positions))[0], net(x)[0])


def test_masked_targets_carry_no_loss_and_no_gradient():
    logits = torch.randn(2, 6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 6))
    keep = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    loss = lm_loss(logits, targets.masked_fill(~keep, IGNORE))
    loss.backward()
    assert (logits.grad[~keep] == 0).all()
    assert (logits.grad[keep].abs().sum(-1) > 0).all()
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, expected)


def test_a_batch_with_nothing_to_learn_gives_zero_not_nan():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    loss = lm_loss(logits, torch.full((1, 4), IGNORE))
    loss.backward()
    assert float(loss.detach()) == 0.0 and (logits.grad == 0).all()


def _document_batches(step: int, cfg):
    """Rows of random documents of random lengths, the first three targets of each masked
    like a prompt."""
    g = torch.Generator().manual_seed(500 + step)
    B, T = cfg.train.micro_batch, cfg.model.seq_len
    out = []
    for _ in range(cfg.train.grad_accum):
        starts = torch.rand(B, T + 1, generator=g) < 0.15
        starts[:, 0] = True
        positions = positions_in_documents(starts)
        tokens = torch.randint(0, 256, (B, T + 1), generator=g)
        y = tokens[:, 1:].masked_fill(positions[:, 1:] < 3, IGNORE)  # prompt and boundaries
        out.append((tokens[:, :-1].contiguous(), y.contiguous(), positions[:, :-1].contiguous()))
    return out


@pytest.mark.parametrize(
    "arch,ckpt,order,accum", [("gpt", True, "unit", 2), ("llama", False, "micro", 2)]
)
def test_swapped_packed_training_equals_plain_pytorch(arch, ckpt, order, accum, monkeypatch):
    import atom.model.documents as documents

    monkeypatch.setattr(documents, "QUERY_CHUNK", 8)  # several chunks per row
    cfg = tiny_config(
        model={"arch": arch},
        train={"grad_accum": accum},
        swap={"checkpoint": ckpt, "order": order},
    )
    swapped = SwapEngine(cfg, CpuBackend(), torch.float32)
    resident = ResidentEngine(cfg, torch.device("cpu"), torch.float32)
    try:
        for step in range(4):
            batches = _document_batches(step, cfg)
            lr = lr_at(step, cfg.train)
            a, b = swapped.train_step(batches, lr).loss, resident.train_step(batches, lr).loss
            assert abs(a - b) <= 1e-5 * abs(b)
        val = _document_batches(99, cfg)
        assert abs(swapped.evaluate(val) - resident.evaluate(val)) <= 1e-5
        ref = resident.named_parameters()
        for name, p in swapped.named_parameters().items():
            assert rel_err(p, ref[name]) <= 1e-5, name
    finally:
        swapped.close()


LLAMA_FAMILY = {
    "llama (GQA)": {"arch": "llama", "n_kv_head": 2},
    "mistral (GQA, window)": {"arch": "llama", "n_kv_head": 2, "sliding_window": 6},
    "qwen2 (GQA, qkv bias, window)": {
        "arch": "llama", "n_kv_head": 1, "qkv_bias": True, "sliding_window": 9,
    },
}  # fmt: skip


@pytest.mark.parametrize("model", LLAMA_FAMILY.values(), ids=LLAMA_FAMILY.keys())
def test_masked_attention_never_asks_sdpa_for_gqa(model, monkeypatch):
    """Flash attention takes no mask and memory-efficient attention takes no enable_gqa:
    a masked call with grouped-query heads could only run on the math kernel (fp32
    scores, more memory than planned). Every masked call must come with as many K/V heads
    as query heads, and give what SDPA's own GQA gives."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    calls = []

    def recording(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        calls.append((attn_mask is not None, enable_gqa, q.size(1), k.size(1)))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    net = _model(**model)
    _, row, positions = _packed([7, 12, 13])
    loss = net(row, row.roll(-1, 1), docs=Documents(positions))[1]  # packed documents
    loss.backward()
    net(row, row.roll(-1, 1))  # a window shorter than the row (mistral, qwen2): a band mask
    masked = [c for c in calls if c[0]]
    assert masked, "no masked call was made: the test would prove nothing"
    assert all(not gqa and q_heads == kv_heads for _, gqa, q_heads, kv_heads in masked), masked


def test_expanded_heads_attend_as_sdpa_gqa_does():
    import torch.nn.functional as F

    from atom.model.sdpa import attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 10, 16, generator=g)
    k, v = torch.randn(2, 2, 10, 16, generator=g), torch.randn(2, 2, 10, 16, generator=g)
    mask = torch.rand(2, 1, 10, 10, generator=g) < 0.7
    mask |= torch.eye(10, dtype=torch.bool)  # every query sees at least itself
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v, mask=mask), want)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v, causal=True), causal)
