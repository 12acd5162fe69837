"""One chunk of a unit's AdamW update on whichever device its tensors are on: what the
card update (atom/swap/card_update.py) runs on the device after streaming the chunk's
state there. Same arithmetic as the host update of the same state format:

- fp32 state: torch's fused AdamW kernel (`torch._fused_adamw_`), the one the host's
  `torch.optim.AdamW(fused=True)` runs. Elementwise, so a chunk of the unit gets the bits
  the whole unit would: on the CPU backend the card update equals the host update bit
  for bit (tests/test_card_update.py).
- compact state: `moments_and_master` and `encode_moments` (atom/optim/compact_kernel.py),
  the compiled host update's two expressions, on the exact fp32 master (bf16 + remainder),
  its 16-bit halves read and written as int16 (native on a card; the compiled host loop
  reads them as bf16 and writes int32 scratch, for want of int16 vector code).
- bf16 state: the host update's own chunk function (atom/optim/bf16.py `update_chunk`),
  on the gradient rounded to bf16 as the host lands it, so the two give the same bits.
"""

from __future__ import annotations

import math

import torch

from atom.optim.bf16 import Bf16Scratch, update_chunk
from atom.optim.compact import CHUNK, padded
from atom.optim.compact_kernel import BLOCK, encode_moments, moments_and_master
from atom.optim.state import ADAM_EPS


def fp32_chunk(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    n_decay: int,
) -> None:
    """AdamW on fp32 chunks in place, the first `n_decay` elements weight-decayed; `step`
    is the step count after this update (torch increments before its kernel)."""
    parts = ((slice(0, n_decay), weight_decay), (slice(n_decay, master.numel()), 0.0))
    for where, wd in parts:
        if where.stop <= where.start:
            continue
        # a fill on the device, not a copy of a host scalar (whose host memory could go
        # before an asynchronous copy read it)
        steps = [torch.full((), float(step), device=master.device)]
        torch._fused_adamw_(
            [master[where]], [grad[where]], [exp_avg[where]], [exp_avg_sq[where]], [], steps,
            amsgrad=False, lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=wd,
            eps=ADAM_EPS, maximize=False,
        )  # fmt: skip


def compact_scalars(
    coef: float,
    lr: float,
    step: int,
    betas: tuple[float, float],
    weight_decay: float,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """The per-step numbers of `compact_chunk` as 0-d tensors on `device` (coef, lr/bc1,
    1/sqrt(bc2), lr*wd, 0): a Python float would be a constant to a compiler. Filled on
    the device, not copied from host scalars (whose memory could go before an asynchronous
    copy read it)."""
    bc1 = 1 - betas[0] ** step
    rbc2 = 1 / math.sqrt(1 - betas[1] ** step)
    values = (coef, lr / bc1, rbc2, lr * weight_decay, 0.0)
    return tuple(torch.full((), x, dtype=torch.float32, device=device) for x in values)


def compact_chunk(
    grad, master, rem, m_codes, m_scales, s_codes, s_scales,
    scalars: tuple[torch.Tensor, ...], betas: tuple[float, float], n_decay: int,
) -> None:  # fmt: skip
    """The compact update of one chunk in place (a whole number of BLOCKs long: the
    caller pads the last one with zero gradient). `n_decay`: its decayed elements come
    first; in a chunk the decay boundary cuts, the decay rate is a per-element tensor
    (cutting the chunk there would cut a moment's block of BLOCK elements)."""
    coef, lr_bc1, rbc2, lr_wd, zero = scalars
    n = grad.numel()
    m_out, s_out = torch.empty(n, device=grad.device), torch.empty(n, device=grad.device)
    if n_decay in (0, n):
        wd = lr_wd if n_decay else zero
    else:  # a per-element decay rate: the formula takes a tensor there as well as a scalar
        wd = torch.zeros(n, device=grad.device)
        wd[:n_decay] = lr_wd
    hi = master.view(torch.int16)  # read whole before written: eager, so in place is fine
    moments_and_master(grad, hi, rem, m_codes, m_scales, s_codes, s_scales, coef, lr_bc1,
                       rbc2, wd, betas[0], betas[1], m_out, s_out, hi, rem)  # fmt: skip
    encode_moments(m_out, s_out, m_codes, m_scales, s_codes, s_scales)


def bf16_chunk(
    grad: torch.Tensor,
    w: torch.Tensor,
    codes: list[torch.Tensor],
    coef: float,
    numbers: tuple[float, ...],
    betas: tuple[float, float],
    n_decay: int,
    key: int,
    start: int,
    scratch: Bf16Scratch,
) -> None:
    """The bf16 update of one device chunk in place: `grad` (fp32, the card's sum), the bf16
    weights `w`, `codes` (m codes, m scales, sqrt(v) codes, sqrt(v) scales over whole
    blocks), the step's `numbers` and `key` (Bf16AdamW.begin_step), `start` the chunk's
    first element in the unit. The gradient is rounded to bf16 first, as the host's
    landing rounds it (the card and host updates then agree bit for bit), and the chunk
    is updated CHUNK elements at a time in `scratch`, as the host's (elementwise within
    each block, so the pieces do not change the bits)."""
    g16 = grad.to(torch.bfloat16)
    m_codes, m_scales, s_codes, s_scales = codes
    for at in range(0, w.numel(), CHUNK):
        end = min(w.numel(), at + CHUNK)
        span = padded(end - at)
        blocks = slice(at // BLOCK, (at + span) // BLOCK)
        part = (m_codes[at : at + span], m_scales[blocks], s_codes[at : at + span],
                s_scales[blocks])  # fmt: skip
        decayed = max(0, min(end - at, n_decay - at))
        update_chunk(w[at:end], g16[at:end], coef, part, numbers, betas, decayed, key,
                     start + at, scratch)  # fmt: skip
