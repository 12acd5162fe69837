"""The compact update of one whole chunk as two compiled loops (`swap.compile_update`).

CompactAdamW's eager update makes ~45 passes of torch ops over each chunk (decode two
moments, AdamW, the remainder split, encode two moments), each one a trip through memory. Written as
two expressions (the moments and the master; the moments' encoding) and compiled by
torch.compile (Inductor's C++ code generation), the same arithmetic is a few vectorised
loops: `python -m tools.bench.host_update` measures both.

What it is not: bit-equal to the eager update. An fp32 value summed in another order can
round to the neighbouring float8 code of a moment, or to the neighbouring fp32 master.
A run uses one path throughout, so a resume is exact either way.

Only whole chunks of CHUNK elements, decayed all or none, come here: one shape, so one
compile of each half per process (Inductor caches them on disk for the next). A unit's
last, shorter chunk, a chunk the decay boundary cuts, and every unit smaller than a chunk
take the eager path. Where the compiler is missing (no C++ compiler; a torch without Inductor) the
first call (on copies of the chunk) fails before it touches anything, says so once, and
the eager path does all.
"""

from __future__ import annotations

import logging
import time

import torch

from atom.optim.remainder import join_wide, narrow_into, split_wide
from atom.optim.state import ADAM_EPS

log = logging.getLogger(__name__)

# the compact format (atom/compact_adamw.py takes them from here)
BLOCK = 256  # elements per fp32 scale of a moment
F8 = torch.float8_e4m3fn
F8_MAX = 448.0
TINY = 1e-30  # the scale of an all-zero block (its codes are zero whatever the scale)


def moments_and_master(grad, master, rem, m_codes, m_scales, s_codes, s_scales,
                       coef, lr_bc1, rbc2, lr_wd, b1: float, b2: float,
                       m_out, s_out, hi_out, rem_out) -> None:  # fmt: skip
    """CompactAdamW.step's arithmetic on one chunk but the moments' encoding and the
    master's store: decode the moments, AdamW (torch's formula) on the exact fp32 master
    (bf16 + remainder); the new moments go to fp32 `m_out`, `s_out` for `encode_moments`,
    the new master's halves to `hi_out`, `rem_out`. `master`, `rem`: the 16-bit halves
    as bf16 (the compiled host update: no int16 in the loop, so Inductor vectorises it;
    its outputs are int32 scratch for `narrow_into`) or as int16 (the card's eager update,
    whose outputs are the same two tensors) (atom/optim/remainder.py). The
    per-step numbers are 0-d tensors (a Python float is a constant to the compiler: a new
    value every step would compile again every step); b1, b2 are the run's constants."""
    g = grad.float() * coef
    m = (m_codes.view(F8).float().view(-1, BLOCK) * m_scales.unsqueeze(1)).view(-1)
    s = (s_codes.view(F8).float().view(-1, BLOCK) * s_scales.unsqueeze(1)).view(-1)
    m = torch.lerp(m, g, 1 - b1)
    s = torch.sqrt(s * s * b2 + g * g * (1 - b2))
    m_out.copy_(m)
    s_out.copy_(s)
    p0 = join_wide(master, rem)
    new_hi, new_rem = split_wide(p0 + (-lr_bc1 * m / (s * rbc2 + ADAM_EPS) - lr_wd * p0))
    hi_out.copy_(new_hi)
    rem_out.copy_(new_rem)


def encode_moments(m, s, m_codes, m_scales, s_codes, s_scales) -> None:
    """Both moments to float8 codes, with an fp32 scale per BLOCK."""
    for x, codes, scales in ((m, m_codes, m_scales), (s, s_codes, s_scales)):
        blocks = x.view(-1, BLOCK)
        scale = torch.clamp(blocks.abs().amax(dim=1), min=TINY) / F8_MAX
        scales.copy_(scale)
        codes.copy_((blocks / scale.unsqueeze(1)).view(-1).to(F8).view(torch.uint8))


class CompiledChunkUpdate:
    """`moments_and_master` then `encode_moments` under torch.compile, compiled on first
    use and shared by the unit optimizers of one engine, with their scratch for the
    moments (fp32) and the master's two halves (int32, narrowed into the int16 state by
    one eager copy each: int16 in the loop made Inductor drop its vector code, issue 49):
    16 MiB. Two compiled loops, not one: in one, Inductor recomputed the decoded moments
    and AdamW for each pass the encoding makes over a block (its maximum, then the codes),
    and the update ran 1.2-1.4x slower than with the moments written to scratch in between
    (`python -m tools.bench.host_update`: 6.84 against 5.75 ns a parameter on one core,
    4.33 against 3.09 on two; docs/benchmarks.md). `__call__` returns False, having
    touched nothing, once the compile has failed: the caller updates that chunk eagerly."""

    def __init__(self, b1: float, b2: float):
        self.b1, self.b2 = b1, b2
        self.available = True
        self.compile_s: float | None = None  # how long the first call took
        self._update = self._encode = None
        self._scratch: tuple[torch.Tensor, ...] | None = None

    def prepare(self, numel: int) -> None:
        """Compile now, on the calling thread, for chunks of `numel` elements (on stand-in
        tensors): the engine calls it at its start, on the training thread. Compiled on the
        host worker during the first step instead, Dynamo (not thread-safe) ran beside the
        training thread's compiled blocks, and the first update stalled for the compile."""
        if self.compile_s is not None or not self.available:
            return
        zeros = [torch.zeros(numel, dtype=d) for d in (torch.bfloat16, torch.bfloat16, torch.int16)]
        codes = [torch.zeros(numel, dtype=torch.uint8), torch.full((numel // BLOCK,), TINY)]
        scalars = tuple(torch.tensor(x) for x in (1.0, 1e-3, 1.0, 0.0))
        self(*zeros, *codes, *[c.clone() for c in codes], scalars)

    def __call__(self, grad, master, rem, m_codes, m_scales, s_codes, s_scales,
                 scalars: tuple[torch.Tensor, ...]) -> bool:  # fmt: skip
        if not self.available:
            return False
        n = grad.numel()
        if self._scratch is None or self._scratch[0].numel() != n:
            self._scratch = (torch.empty(n), torch.empty(n), *torch.empty(2, n, dtype=torch.int32))
        m, s, hi32, rem32 = self._scratch
        codes = (m_codes, m_scales, s_codes, s_scales)
        # the remainder's storage read as bf16 in the loop: see atom/optim/remainder.py
        args = (grad, master, rem.view(torch.bfloat16), *codes, *scalars, self.b1, self.b2,
                m, s, hi32, rem32)  # fmt: skip
        if self.compile_s is not None:
            self._update(*args)
            narrow_into(hi32, rem32, master, rem)
            self._encode(m, s, *codes)
            return True
        t0 = time.perf_counter()
        log.info("compiling the compact update (the first run on a machine takes ~30 s)")
        try:
            update = torch.compile(moments_and_master, dynamic=False, fullgraph=True)
            encode = torch.compile(encode_moments, dynamic=False, fullgraph=True)
            # compiled on copies: a compile error in the second half must not leave the
            # chunk half updated by the first for the eager update to update again
            trial = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            update(*trial)
            encode(trial[-4], trial[-3], *trial[3:7])
        except Exception as err:  # no C++ compiler, no Inductor: the eager update does all
            self.available = False
            log.warning(
                "the compact update does not compile here (%s: %s): updating eagerly, "
                "about 2x slower on the host (swap.compile_update=false skips the attempt)",
                type(err).__name__,
                str(err).splitlines()[0][:200] if str(err) else "",
            )
            return False
        self._update, self._encode = update, encode
        self.compile_s = time.perf_counter() - t0
        log.info("compiled the compact update in %.0f s", self.compile_s)
        update(*args)
        narrow_into(hi32, rem32, master, rem)
        encode(m, s, *codes)
        return True
