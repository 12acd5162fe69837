"""The training loss without the whole logits: the head's projection and cross-entropy a
chunk of tokens at a time (as torchtune's LinearCrossEntropyLoss). Where every token fits
one chunk, its fp32 softmax is kept for the backward instead (no recompute: small models
with large vocabularies would pay a third more head FLOPs for memory they do not need).

For a 128k vocabulary at 2 x 2048 tokens the logits are 1 GiB in bf16 and their fp32
log-softmax and its gradient 2 GiB each: the largest buffers of a step. Here forward and
backward each hold one chunk's logits (CHUNK_ELEMENTS of them, 256 MiB in fp32), the
backward recomputing them; what is saved is the normed input and one fp32 log-sum-exp a
token. The weight's gradient is summed over chunks in the weight's dtype (as autograd
would sum a tied weight's).

`head_loss(head, h, targets)` is the loss of every atom head (a norm, then `lm_head`); the
mean over the targets that count, as atom.model.common.lm_loss, which it replaces in
training.
"""

from __future__ import annotations

import torch

from atom.model.documents import IGNORE

CHUNK_ELEMENTS = 1 << 26  # logits per chunk: tokens x vocabulary


def chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets):
        n, chunk = x.shape[0], chunk_tokens(weight.shape[0])
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        ctx.mm_dtype = x.dtype
        for s in range(0, n, chunk):
            # the projection in the compute dtype (autocast's, if on), the softmax in fp32
            mm = x[s : s + chunk] @ weight.t()
            ctx.mm_dtype = mm.dtype
            logits = mm.float()
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            tgt = targets[s : s + chunk]
            picked = logits.gather(1, tgt.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((lse[s : s + chunk] - picked) * (tgt != IGNORE)).sum()
        count = (targets != IGNORE).sum().clamp(min=1)
        # one chunk holds every token: keep its softmax rather than recompute the
        # projection in the backward (a third more head FLOPs; the buffer is the size the
        # chunk's logits would be anyway)
        probs = torch.exp(logits - lse[:, None]) if n <= chunk else None
        ctx.save_for_backward(x, weight, targets, lse, count, probs)
        return total / count

    @staticmethod
    def backward(ctx, grad):
        x, weight, targets, lse, count, kept = ctx.saved_tensors
        n, chunk = x.shape[0], chunk_tokens(weight.shape[0])
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = grad / count
        # the backward runs outside autocast: recompute in the forward's matmul dtype, so
        # the logits are the forward's and the softmax sums to one
        mm = ctx.mm_dtype
        w = weight.to(mm)
        for s in range(0, n, chunk):
            xs, tgt = x[s : s + chunk].to(mm), targets[s : s + chunk]
            # d loss / d logits = (softmax - one-hot) / count, zero where no target counts
            if kept is not None:
                p = kept
            else:
                p = (xs @ w.t()).float().sub_(lse[s : s + chunk, None]).exp_()
            valid = tgt != IGNORE
            p.scatter_add_(1, tgt.clamp(min=0).unsqueeze(1), -valid.unsqueeze(1).to(p.dtype))
            p.mul_((scale * valid).unsqueeze(1))
            g = p.to(mm)
            if gx is not None:
                gx[s : s + chunk] = g @ w
            if gw is not None and gw.dtype == mm:
                gw.addmm_(g.t(), xs)  # in place: no weight-sized temporary per chunk
            elif gw is not None:
                gw += g.t() @ xs  # fp32 weights under autocast
        return gx, gw, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Mean cross-entropy of `x @ weight.T` against `targets` (IGNORE: no loss), the
    logits never whole."""
    flat = x.reshape(-1, x.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1))


def head_loss(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of an atom head (`norm`, then `lm_head` without a bias) on hidden `h`."""
    return linear_cross_entropy(head.norm(h), head.lm_head.weight, targets)
