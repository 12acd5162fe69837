"""The chunked head loss (atom/model/head_loss.py) against the whole-logits lm_loss: the
same loss and gradients, with no tensor of the logits' size kept for the backward."""

from __future__ import annotations

import pytest
import torch

from atom.model import head_loss as hl
from atom.model.common import lm_loss
from atom.model.documents import IGNORE


def _case(dtype, seed=0, vocab=50, d=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 37, d, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, d, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (2, 37), generator=g)
    t[0, :5] = IGNORE  # a prompt's tokens carry no loss
    return x, w, t


@pytest.mark.parametrize("chunk_elements", [1 << 26, 1000, 50])  # one chunk; 20; 1 token each
def test_chunked_loss_and_gradients_equal_the_whole_logits(monkeypatch, chunk_elements):
    monkeypatch.setattr(hl, "CHUNK_ELEMENTS", chunk_elements)
    x, w, t = _case(torch.float32)
    got = hl.linear_cross_entropy(x, w, t)
    g_got = torch.autograd.grad(got, [x, w])
    want = lm_loss(x @ w.t(), t)
    g_want = torch.autograd.grad(want, [x, w])
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for a, b in zip(g_got, g_want, strict=True):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_no_target_that_counts_gives_zero_not_nan():
    x, w, t = _case(torch.float32)
    t.fill_(IGNORE)
    loss = hl.linear_cross_entropy(x, w, t)
    gx, gw = torch.autograd.grad(loss, [x, w])
    assert float(loss) == 0.0 and not gx.any() and not gw.any()


def test_nothing_of_the_logits_size_is_kept_for_the_backward(monkeypatch):
    monkeypatch.setattr(hl, "CHUNK_ELEMENTS", 1000)  # 20 tokens of the 74 at a time
    x, w, t = _case(torch.float32, vocab=50)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s.numel()) or s,
                                                  lambda s: s):  # fmt: skip
        loss = hl.linear_cross_entropy(x, w, t)
    loss.backward()
    logits = x.shape[0] * x.shape[1] * w.shape[0]
    assert saved and max(saved) < logits / 2, saved


def test_bf16_tracks_fp32():
    x, w, t = _case(torch.bfloat16)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss, loss32 = hl.linear_cross_entropy(x, w, t), hl.linear_cross_entropy(x32, w32, t)
    assert float(loss) == pytest.approx(float(loss32), rel=1e-2)


def test_under_autocast_the_backward_recomputes_the_forwards_logits():
    """The engines' resident path runs the loss under autocast, the backward outside it:
    the recomputed logits must be the forward's (bf16 matmuls), or the softmax does not
    sum to one and every gradient is off by its error."""
    x, w, t = _case(torch.float32, vocab=300, d=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hl.linear_cross_entropy(x, w, t)
        want = lm_loss(x @ w.t(), t)
    g_got = torch.autograd.grad(got, [x, w])
    g_want = torch.autograd.grad(want, [x, w])
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).norm() <= 2e-3 * b.norm()


def test_one_chunk_keeps_its_softmax_instead_of_recomputing(monkeypatch):
    """Every token in one chunk: the backward makes no projection of its own (small
    models with large vocabularies would pay a third more head FLOPs), and the gradients
    are the whole-logits ones."""
    x, w, t = _case(torch.float32)
    loss = hl.linear_cross_entropy(x, w, t)
    calls = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append(1) or real(a, b))
    gx, gw = torch.autograd.grad(loss, [x, w])
    want = torch.autograd.grad(lm_loss(real(x, w.t()), t), [x, w])
    assert len(calls) == 1  # the input gradient's product (the weight's is an addmm_): no logits
    assert (gx - want[0]).abs().max() <= 1e-6 * want[0].abs().max()
    assert (gw - want[1]).abs().max() <= 1e-6 * want[1].abs().max()
