"""bf16 state for one unit (`swap.state: bf16`): the bf16 weights are the master (no fp32
master, no remainder), AdamW moments in 8 bits exactly as compact state keeps them, a
bf16 host gradient. Lighter than compact, and not exact: opt in.

Bytes per parameter in host RAM:

    weights  bf16    2   the master and, on a bf16 device, the copy that crosses the bus
    grad     bf16    2   (none for a unit updated on the card)
    m, sqrt(v)  fp8  1+1 (+ one fp32 scale per 256: 0.03)
                    ---
                     6   (4 for a unit updated on the card; compact is 8, fp32 16)

The update is compact's AdamW (torch's formula, decoupled weight decay, the clip
coefficient) computed in fp32 from the bf16 weight, then rounded back to bf16
*stochastically*: a random integer in [0, 2^16) is added to the fp32 result's bits and
the low 16 bits are dropped (torchao's `_fp32_to_bf16_sr`, what its AdamW's
`bf16_stochastic_round` does). A value a fraction f of the way from one bf16 to the next
rounds up with probability f, so an update under half a bf16 ulp, which round-to-nearest
would drop every time, moves the weight by its own size on average. A result that is a
bf16 already (low bits zero) is kept exactly.

The random integers are not drawn from a generator: they are a counter-based hash of
(run seed, unit, step, element index), in int64 torch ops, so they are the same on every
device and for any chunking (the card update equals the host update bit for bit), and a
resume is exact with no RNG state in the checkpoint.

Non-finite values: NaN stays NaN (its random add is zeroed: a carry out of a NaN's bits
would wrap into the sign bit, a zero; and its quiet bit is set, as torch's conversion
does). inf stays inf (its low bits are zero). A finite fp32 result beyond bf16's largest
finite value (3.39e38) rounds up to inf with the probability of its fraction, as
torchao's does: only a value round-to-nearest would nearly have sent there too, far past
any weight a training keeps.

Checkpoints hold the same fp32 tensors as the other states (weights, m, v), so a run
resumes across `swap.state` settings: fp32 or compact weights load rounded to the nearest
bf16; a bf16 checkpoint resumes bit for bit.
"""

from __future__ import annotations

import math

import torch

from atom.config import TrainConfig
from atom.optim.compact import CHUNK, decode, encode, padded
from atom.optim.compact_kernel import BLOCK, TINY
from atom.optim.state import ADAM_EPS, Region

M32 = 0xFFFFFFFF
# the multipliers of the hash's rounds: odd and under 2^31, so a 32-bit value times one
# fits an int64 (no signed overflow, which the C++ behind torch leaves undefined)
MUL1 = 0x7FEB352D  # lowbias32's first (Wellons' hash prospector)
MUL2 = 0x5BD1E995  # MurmurHash2's


def mix32(x: int) -> int:
    """The hash's rounds on a Python int (a 32-bit value): as `_mix_` does per element."""
    x ^= x >> 16
    x = (x * MUL1) & M32
    x ^= x >> 15
    x = (x * MUL2) & M32
    return x ^ (x >> 16)


def stream_key(seed: int, unit: int, step: int) -> int:
    """The 32-bit key of one unit's step: its elements' random integers are
    mix32(index ^ key) >> 16."""
    return mix32((mix32((mix32(step & M32) + unit) & M32) + seed) & M32)


def _mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """mix32 per element of int64 `x` (values in [0, 2^32)), in place. Every value stays
    non-negative, so torch's arithmetic >> is the logical one the hash wants."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(MUL1).bitwise_and_(M32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    x.mul_(MUL2).bitwise_and_(M32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def random_bits(
    key: int, start: int, n: int, out: torch.Tensor | None = None, tmp: torch.Tensor | None = None
) -> torch.Tensor:
    """Random integers in [0, 2^16) for elements start..start+n-1 of a unit's step
    (`key`: stream_key), int64, on `out`'s device. `out`, `tmp`: int64 scratch, n long."""
    out = torch.empty(n, dtype=torch.int64) if out is None else out
    tmp = torch.empty_like(out) if tmp is None else tmp
    torch.arange(start, start + n, out=out)
    out.bitwise_xor_(key)  # two 32-bit values: 32 bits (a unit holds under 2^32 elements)
    return _mix_(out, tmp).bitwise_right_shift_(16)


def round_stochastic(
    x: torch.Tensor, out: torch.Tensor, key: int, start: int, ints: list[torch.Tensor]
) -> None:
    """fp32 `x` -> bf16 `out`, rounded stochastically with the random integers of
    elements start.. of the stream `key`. `ints`: two int64 scratch tensors, len(x) long.
    The bit work runs in int64: a negative fp32's bits sign-extend, and adding to them
    moves its magnitude up as for a positive one (torchao's rounding, sign-magnitude)."""
    r, bits = ints
    random_bits(key, start, x.numel(), r, bits)
    if x.device.type == "cpu" and not torch.isnan(x).any():
        # the same bits without the NaN masks' eight passes; on a GPU the test would make
        # the host wait for the device, and the masks cost little there
        bits.copy_(x.view(torch.int32)).add_(r).bitwise_right_shift_(16)
        out.view(torch.int16).copy_(bits)
        return
    # NaN: no add (a carry out of its bits would wrap into the sign bit, a zero), and its
    # quiet bit set (a NaN whose mantissa is all in the low half would truncate to inf).
    # The masks in place, no boolean tensor: 0x7F800000 - |bits| is negative just for
    # NaN, and >> 63 spreads its sign over the word
    bits.copy_(x.view(torch.int32)).bitwise_and_(0x7FFFFFFF).neg_().add_(0x7F800000)
    r.bitwise_and_(bits.bitwise_right_shift_(63).bitwise_not_())  # 0 for NaN, -1 else
    bits.bitwise_not_().bitwise_and_(0x400000).bitwise_or_(x.view(torch.int32))
    bits.add_(r).bitwise_right_shift_(16)
    out.view(torch.int16).copy_(bits)  # the upper half, which fits int16 for every non-NaN


# a chunk's temporaries: fp32 operands, and the rounding's int64 random bits and work
SCRATCH_FP32, SCRATCH_INT64 = 6, 2
SCRATCH_BYTES = 4 * SCRATCH_FP32 + 8 * SCRATCH_INT64  # an element of a chunk


class Bf16Scratch:
    """The temporaries of one chunk's update: five fp32 (gradient, weight, two moments, the
    update), one for the moments' codec, two int64 for the rounding. Shared by the unit
    optimizers of one engine (its host worker runs one update at a time); on the device,
    made per card update."""

    def __init__(self, largest: int, device: torch.device | str = "cpu"):
        size = min(CHUNK, padded(largest))
        self._f = [torch.empty(size, device=device) for _ in range(SCRATCH_FP32)]
        self._i = [
            torch.empty(size, dtype=torch.int64, device=device) for _ in range(SCRATCH_INT64)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self._f, *self._i))

    def views(self, span: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [t[:span] for t in self._f], [t[:span] for t in self._i]


def update_chunk(
    w: torch.Tensor,
    grad: torch.Tensor,
    coef: float,
    codes: tuple[torch.Tensor, ...],
    numbers: tuple[float, float, float, float],
    betas: tuple[float, float],
    decayed: int,
    key: int,
    start: int,
    scratch: Bf16Scratch,
) -> None:
    """One chunk of the bf16 update in place, on whichever device its tensors are: `w` the
    bf16 weights (n), `grad` their gradient (n, any float dtype; the host's is bf16),
    `codes` (m codes, m scales, sqrt(v) codes, sqrt(v) scales) over padded(n), `numbers`
    (lr, 1 - beta1^t, 1/sqrt(1 - beta2^t), lr * weight decay), the first `decayed`
    elements weight-decayed; `start`: the chunk's first element in the unit (its random
    integers). The arithmetic is compact's eager update (atom/optim/compact.py) on the
    bf16 weight's fp32 value."""
    n, span = w.numel(), padded(w.numel())
    (p0, g, m, s, work, tmp), ints = scratch.views(span)
    lr, bc1, rbc2, lr_wd = numbers
    b1, b2 = betas
    m_codes, m_scales, s_codes, s_scales = codes
    g[:n].copy_(grad)
    g[n:].zero_()  # padding: zero gradient keeps its moments at zero
    if coef != 1.0:
        g.mul_(coef)
    decode(m_codes, m_scales, m, tmp)
    decode(s_codes, s_scales, s, tmp)
    m.lerp_(g, 1 - b1)
    s.mul_(s).mul_(b2).addcmul_(g, g, value=1 - b2).sqrt_()
    # the update, as torch's AdamW: -lr*wd*p - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
    torch.mul(s, rbc2, out=work).add_(ADAM_EPS)
    torch.div(m, work, out=work).mul_(-lr / bc1)
    p = p0[:n].copy_(w)
    if decayed and lr_wd:
        work[:decayed].add_(p[:decayed], alpha=-lr_wd)
    p.add_(work[:n])
    round_stochastic(p, w, key, start, [t[:n] for t in ints])
    encode(m, m_codes, m_scales, tmp)
    encode(s, s_codes, s_scales, tmp)


class Bf16AdamW:
    """AdamW over one unit's bf16 state: `master` (bf16, the weights) and `grad` (bf16)
    are the unit's host buffers (`n` owned parameters, the first `n_decay` of them
    decayed), `unit` its index (with cfg.seed, the rounding's stream); the moments live
    here, as CompactAdamW's. paged: master and the moments are placeholders the disk tier
    points into a RAM slot around each update (`regions`). `moments`: page-locked buffers
    for a unit updated on the device (atom/swap/card_update.py updates it; `step` is
    never called)."""

    def __init__(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        n: int,
        n_decay: int,
        unit: int,
        cfg: TrainConfig,
        scratch: Bf16Scratch,
        paged: bool = False,
        moments: tuple[torch.Tensor, ...] | None = None,
    ):
        self.master, self.grad = master, grad
        self.n, self.n_decay, self.unit = n, n_decay, unit
        self.cfg = cfg
        p = 0 if paged else padded(n)
        self.m_codes = torch.zeros(p, dtype=torch.uint8)
        self.s_codes = torch.zeros(p, dtype=torch.uint8)  # sqrt of the second moment
        self.m_scales = torch.full((p // BLOCK,), TINY)
        self.s_scales = torch.full((p // BLOCK,), TINY)
        if moments is not None:
            self.m_codes, self.s_codes, self.m_scales, self.s_scales = moments
            self.m_codes.zero_(), self.s_codes.zero_()
            self.m_scales.fill_(TINY), self.s_scales.fill_(TINY)
        self.steps = 0
        self.scratch = scratch

    def regions(self) -> list:
        """The unit's cold state for the disk tier: weights, codes and scales."""
        n, p = self.n, padded(self.n)
        return [
            Region(torch.bfloat16, n, [(self.master, 0, (n,))]),
            Region(torch.uint8, p, [(self.m_codes, 0, (p,))]),
            Region(torch.uint8, p, [(self.s_codes, 0, (p,))]),
            Region(torch.float32, p // BLOCK, [(self.m_scales, 0, (p // BLOCK,))]),
            Region(torch.float32, p // BLOCK, [(self.s_scales, 0, (p // BLOCK,))]),
        ]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.m_codes, self.s_codes, self.m_scales, self.s_scales))

    def begin_step(self, lr: float) -> tuple[tuple[float, ...], tuple[float, float], int]:
        """Advance the step count; the step's (numbers for update_chunk, betas, key)."""
        cfg = self.cfg
        self.steps += 1
        numbers = (
            lr,
            1 - cfg.beta1**self.steps,
            1 / math.sqrt(1 - cfg.beta2**self.steps),
            lr * cfg.weight_decay,
        )
        key = stream_key(cfg.seed, self.unit, self.steps)
        return numbers, (cfg.beta1, cfg.beta2), key

    def codes(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """The moments' codes and scales of elements start..end (start a multiple of BLOCK),
        over whole blocks."""
        span = padded(end - start)
        blocks = slice(start // BLOCK, (start + span) // BLOCK)
        return (self.m_codes[start : start + span], self.m_scales[blocks],
                self.s_codes[start : start + span], self.s_scales[blocks])  # fmt: skip

    @torch.no_grad()
    def step(self, lr: float, coef: float = 1.0) -> None:
        assert self.grad.numel() >= self.n, "a unit updated on the device has no host gradient"
        numbers, betas, key = self.begin_step(lr)
        for start in range(0, self.n, CHUNK):
            end = min(self.n, start + CHUNK)
            decayed = max(0, min(end - start, self.n_decay - start))
            update_chunk(
                self.master[start:end], self.grad[start:end], coef, self.codes(start, end),
                numbers, betas, decayed, key, start, self.scratch,
            )  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
    def state_flat(self, key: str) -> torch.Tensor | None:
        """fp32 exp_avg / exp_avg_sq over the unit's owned parameters (None before the
        first step)."""
        if not self.steps:
            return None
        out = torch.empty(padded(self.n))
        if key == "exp_avg":
            decode(self.m_codes, self.m_scales, out)
        else:
            decode(self.s_codes, self.s_scales, out).square_()
        return out[: self.n]

    def load_state_flat(self, key: str, flat: torch.Tensor, steps: int) -> None:
        self.steps = steps
        x = torch.zeros(padded(self.n))
        x[: self.n].copy_(flat)
        if key == "exp_avg":
            encode(x, self.m_codes, self.m_scales)
        else:
            encode(x.clamp_(min=0).sqrt_(), self.s_codes, self.s_scales)
