"""Compact state for one unit: the fp32 master as its bf16 weight plus a 16-bit remainder
(exact) and AdamW moments in 8 bits with a scale per block of 256 (`swap.state: compact`).

Bytes per parameter in host RAM (fp32 state is 16, plus the bf16 copy for the bus):

    master   bf16    2   the fp32 master's upper half, rounded: on a bf16 device it *is*
                         the copy that crosses the bus
    rem      int16   2   the rest of the fp32 master's bits (atom/optim/remainder.py)
    grad     bf16    2
    m, sqrt(v)  fp8  1+1 (+ one fp32 scale per 256: 0.03)
                    ---
                     8

Why these choices:
- bf16 master alone loses updates smaller than half a bf16 ulp (lr * update / |w| under
  2^-9 is common late in training). bf16 + remainder is the fp32 master bit for bit, so
  the update is fp32 AdamW on it (TransformerEngine's `store_param_remainders`); it
  replaced a bf16 Kahan compensation of the same 2 bytes, which tracked fp32 only to the
  compensation's own rounding. Deterministic: resume is exact and needs no RNG state.
- Moments as float8 e4m3 with an absmax scale per block of 256 (torchao's AdamWFp8
  recipe; bitsandbytes' 8-bit Adam is the same idea with a table-driven code): each block
  keeps its own range, so a few large gradients do not flush a block of small ones. The
  second moment is stored as sqrt(v): it scales like the gradient, as m does, so both
  flush to zero at the same gradient size (v itself would flush at the square root of it,
  and a zero denominator under a live m is a huge update).
- Decoding float8 with torch's own conversion measured ~1.7 ns per element on this CPU
  (not vectorised); re-biasing the bits into float16 (int16 ops) and converting that is
  ~5x faster and exact for every code, subnormals included (tests/test_compact_adamw.py
  checks all 256).
- Temporaries are fp32 chunks of CHUNK elements, so a unit of any size is updated with a
  few MiB of scratch, in passes that stay in cache.

Checkpoints hold the same fp32 tensors as the fp32 state (master, m, v), so a run resumes
across `swap.state` settings (a checkpoint of the earlier bf16 + Kahan format held master
+ compensation in fp32 too, and loads the same way).
"""

from __future__ import annotations

import math

import torch

from atom.config import TrainConfig
from atom.optim.compact_kernel import BLOCK, F8, F8_MAX, TINY, CompiledChunkUpdate
from atom.optim.remainder import join_into, split_into
from atom.optim.state import ADAM_EPS, Region

CHUNK = 1 << 20  # elements per pass; a multiple of BLOCK


def padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


SCRATCH_BUFFERS = 6  # five fp32 operands of a chunk's update, one for the codec


class ChunkScratch:
    """fp32 temporaries for one chunk, shared by the unit optimizers of one engine (its
    host worker runs one update at a time). Every temporary of an update lives here: a
    fresh chunk-sized tensor per operation measured several times slower (each is a new
    mapping of pages to fault in)."""

    def __init__(self, largest: int):
        self._buf = [torch.empty(min(CHUNK, padded(largest))) for _ in range(SCRATCH_BUFFERS)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._buf)

    def views(self, span: int) -> list[torch.Tensor]:
        return [t[:span] for t in self._buf]


def encode(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tmp: torch.Tensor | None = None
) -> None:
    """fp32 x (a multiple of BLOCK long) -> uint8 codes (float8 e4m3 bits) and one fp32
    scale per block, with |x| / scale <= 448 (the largest e4m3 value). `tmp`: fp32 scratch
    as long as x."""
    tmp = torch.empty_like(x) if tmp is None else tmp
    blocks, work = x.view(-1, BLOCK), tmp.view(-1, BLOCK)
    torch.amax(torch.abs(blocks, out=work), dim=1, out=scales)
    scales.clamp_(min=TINY).div_(F8_MAX)
    torch.div(blocks, scales.unsqueeze(1), out=work)
    codes.view(F8).copy_(tmp)


def decode(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 codes + scales -> fp32 `out`. The e4m3 bits (sign, 4 exponent, 3 mantissa)
    placed at float16's sign and top exponent/mantissa bits give the same number times
    2^-8 (float16's exponent bias is 8 more), subnormals included; the bit work is in int16
    (a shift into the sign bit wraps, as C++20 defines it). `tmp`: fp32 scratch as long as
    out, which holds the two int16 temporaries."""
    n = out.numel()
    tmp = torch.empty_like(out) if tmp is None else tmp
    a, b = tmp.view(torch.int16)[:n], tmp.view(torch.int16)[n : 2 * n]
    a.copy_(codes)
    torch.bitwise_and(a, 0x80, out=b).bitwise_left_shift_(8)  # sign
    a.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(b)  # exponent and mantissa
    blocks = out.view(-1, BLOCK)
    blocks.copy_(a.view(torch.float16).view(-1, BLOCK))
    blocks.mul_(scales.unsqueeze(1) * 256.0)
    return out


class CompactAdamW:
    """AdamW (torch's formula, decoupled weight decay) over one unit's compact state.

    `master` (bf16), `rem` (int16) and `grad` (bf16) are the unit's host buffers (`n`
    owned parameters, the first `n_decay` of them decayed); the moments live here. `step`
    reads the gradient, applies `coef` (the clip coefficient), and writes master/rem and
    the moments in place. paged: master, rem and the moments are placeholders that the
    disk tier points into a RAM slot around each update (`regions` lays them out).
    `moments`: buffers to hold the codes and scales (page-locked, for a unit updated on
    the device; its `grad` is empty and `step` is never called: atom/swap/card_update.py
    updates it from these buffers)."""

    def __init__(
        self,
        master: torch.Tensor,
        rem: torch.Tensor,
        grad: torch.Tensor,
        n: int,
        n_decay: int,
        cfg: TrainConfig,
        scratch: ChunkScratch,
        paged: bool = False,
        compiled: CompiledChunkUpdate | None = None,
        moments: tuple[torch.Tensor, ...] | None = None,
    ):
        self.master, self.rem, self.grad = master, rem, grad
        self.n = n
        self.n_decay = n_decay
        self.cfg = cfg
        p = 0 if paged else padded(n)
        self.m_codes = torch.zeros(p, dtype=torch.uint8)
        self.s_codes = torch.zeros(p, dtype=torch.uint8)  # sqrt of the second moment
        # an all-zero block's scale; on disk (paged) a fresh record reads as zeros, which
        # decode to zero just the same
        self.m_scales = torch.full((p // BLOCK,), TINY)
        self.s_scales = torch.full((p // BLOCK,), TINY)
        if moments is not None:  # m codes, sqrt(v) codes, their scales: as above, in place
            self.m_codes, self.s_codes, self.m_scales, self.s_scales = moments
            self.m_codes.zero_(), self.s_codes.zero_()
            self.m_scales.fill_(TINY), self.s_scales.fill_(TINY)
        self.steps = 0
        self.scratch = scratch
        self.compiled = compiled  # whole chunks, where it compiles (atom/compact_kernel.py)

    def regions(self) -> list:
        """The unit's cold state for the disk tier: master, rem, codes and scales."""
        n, p = self.n, padded(self.n)
        return [
            Region(torch.bfloat16, n, [(self.master, 0, (n,))]),
            Region(torch.int16, n, [(self.rem, 0, (n,))]),
            Region(torch.uint8, p, [(self.m_codes, 0, (p,))]),
            Region(torch.uint8, p, [(self.s_codes, 0, (p,))]),
            Region(torch.float32, p // BLOCK, [(self.m_scales, 0, (p // BLOCK,))]),
            Region(torch.float32, p // BLOCK, [(self.s_scales, 0, (p // BLOCK,))]),
        ]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.m_codes, self.s_codes, self.m_scales, self.s_scales))

    def _chunks(self):
        for start in range(0, self.n, CHUNK):
            n = min(CHUNK, self.n - start)
            yield start, n, padded(n)

    @torch.no_grad()
    def step(self, lr: float, coef: float = 1.0) -> None:
        # a card unit's empty gradient: its slices would reach the compiled kernel short
        assert self.grad.numel() >= self.n, "a unit updated on the device has no host gradient"
        cfg = self.cfg
        self.steps += 1
        b1, b2 = cfg.beta1, cfg.beta2
        bc1 = 1 - b1**self.steps
        rbc2 = 1 / math.sqrt(1 - b2**self.steps)
        fused = None
        if self.compiled is not None and self.n >= CHUNK:
            wd = cfg.weight_decay
            fused = [torch.tensor(x) for x in (coef, lr / bc1, rbc2, lr * wd, 0.0)]
        for start, n, span in self._chunks():
            end, blocks = start + n, slice(start // BLOCK, (start + span) // BLOCK)
            decayed = max(0, min(n, self.n_decay - start))
            if fused is not None and n == CHUNK and decayed in (0, n):
                scalars = (*fused[:3], fused[3] if decayed else fused[4])
                if self.compiled(
                    self.grad[start:end], self.master[start:end], self.rem[start:end],
                    self.m_codes[start:end], self.m_scales[blocks],
                    self.s_codes[start:end], self.s_scales[blocks], scalars,
                ):  # fmt: skip
                    continue
            p0, g, m, s, work, tmp = self.scratch.views(span)
            g[:n].copy_(self.grad[start:end])
            g[n:].zero_()  # padding: zero gradient keeps its moments at zero
            if coef != 1.0:
                g.mul_(coef)
            decode(self.m_codes[start : start + span], self.m_scales[blocks], m, tmp)
            decode(self.s_codes[start : start + span], self.s_scales[blocks], s, tmp)
            m.lerp_(g, 1 - b1)
            s.mul_(s).mul_(b2).addcmul_(g, g, value=1 - b2).sqrt_()
            # the update, as torch's AdamW: -lr*wd*p - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
            torch.mul(s, rbc2, out=work).add_(ADAM_EPS)
            torch.div(m, work, out=work).mul_(-lr / bc1)
            p0 = join_into(self.master[start:end], self.rem[start:end], p0[:n])  # exact fp32
            if decayed and cfg.weight_decay:
                work[:decayed].add_(p0[:decayed], alpha=-lr * cfg.weight_decay)
            p0.add_(work[:n])
            split_into(p0, self.master[start:end], self.rem[start:end], tmp[:n])
            encode(m, self.m_codes[start : start + span], self.m_scales[blocks], tmp)
            encode(s, self.s_codes[start : start + span], self.s_scales[blocks], tmp)

    # ------------------------------------------------------------------ checkpoints
    def state_flat(self, key: str) -> torch.Tensor | None:
        """fp32 exp_avg / exp_avg_sq over the unit's owned parameters (None before the
        first step, like torch's optimizer state)."""
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
