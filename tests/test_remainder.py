"""The fp32 master as bf16 + 16-bit remainder (atom/optim/remainder.py): exact for every
remainder, the bf16 half the nearest bf16, in place and allocating forms alike.

    pytest tests/test_remainder.py
"""

from __future__ import annotations

import pytest
import torch

from atom.optim.remainder import (
    join,
    join_into,
    join_wide,
    narrow_into,
    split,
    split_into,
    split_wide,
)

# bf16 upper halves: zeros of both signs, subnormals (smallest, largest), the smallest and
# largest normals, ordinary weights, values whose rounding carries into the exponent, and
# the largest finite (where rounding up reaches infinity's bits, and the remainder still
# brings the fp32 value back)
UPPER_HALVES = [
    0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080,
    0x3C23, 0xBC23, 0x3F80, 0xBF80, 0x3F7F, 0x7F7F, 0xFF7F, 0x7F00, 0x4B7F,
]  # fmt: skip


# masters of every kind for the int32 forms: the above, +-inf, NaNs with payloads (quiet,
# signalling, both signs, all mantissa bits set)
KINDS = UPPER_HALVES + [0x7F80, 0xFF80, 0x7FC1, 0xFFA5, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF]


def _all_remainders(upper: int) -> torch.Tensor:
    """The 65,536 fp32 numbers whose upper 16 bits are `upper` (low 16 bits all values)."""
    bits = (torch.tensor(upper & 0xFFFF, dtype=torch.int64) << 16) | torch.arange(65536)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def test_join_of_split_is_bit_exact_for_every_remainder():
    for upper in UPPER_HALVES:
        x = _all_remainders(upper)
        hi, rem = split(x)
        assert hi.dtype == torch.bfloat16 and rem.dtype == torch.int16
        assert torch.equal(join(hi, rem).view(torch.int32), x.view(torch.int32)), hex(upper)


def test_the_bf16_half_is_the_nearest_bf16():
    """Nearest, ties away from zero (TransformerEngine's rounding): no closer bf16 exists
    than the one kept, for every remainder of every upper half (finite values)."""
    for upper in UPPER_HALVES:
        x = _all_remainders(upper).double()
        hi, _ = split(x.float())
        kept = hi.double()
        finite = kept.isfinite()
        err = (kept - x).abs()[finite]
        # the two bf16 neighbours of x: its truncation and one ulp further out
        trunc = _truncate(x.float()).double()
        ulp_out = _truncate(x.float(), up=True).double()
        best = torch.minimum((trunc - x).abs(), (ulp_out - x).abs())[finite]
        assert torch.equal(err, best), hex(upper)
        ties = ((trunc - x).abs() == (ulp_out - x).abs())[finite]
        assert (kept[finite][ties].abs() >= x[finite][ties].abs()).all()  # away from zero


def _truncate(x: torch.Tensor, up: bool = False) -> torch.Tensor:
    bits = x.view(torch.int32) >> 16
    if up:
        bits = bits + 1  # one bf16 ulp further from zero (sign-magnitude bits)
    return (bits << 16).view(torch.float32)


def test_in_place_forms_equal_the_allocating_ones():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4097, generator=g) * torch.exp(torch.randn(4097, generator=g) * 10)
    hi, rem = torch.empty(4097, dtype=torch.bfloat16), torch.empty(4097, dtype=torch.int16)
    split_into(x, hi, rem, torch.empty(4097))
    want_hi, want_rem = split(x)
    assert torch.equal(hi.view(torch.int16), want_hi.view(torch.int16))
    assert torch.equal(rem, want_rem)
    out = join_into(hi, rem, torch.empty(4097))
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


def test_split_traces_under_torch_compile():
    """The compiled compact update (atom/optim/compact_kernel.py) uses both inside one
    compiled function: the compiled split is the eager one, bit for bit."""
    x = _all_remainders(0x3C23)
    compiled = torch.compile(lambda t: join(*split(t * 1.0)), dynamic=False, fullgraph=True)
    assert torch.equal(compiled(x).view(torch.int32), x.view(torch.int32))


def _wide(hi: torch.Tensor, rem16: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (join_wide(hi, rem16), *split_wide(x))


@pytest.mark.slow  # one Inductor compile, ~10 s the first time on 2 cores
@pytest.mark.parametrize("flush_denormal", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_the_int32_forms_equal_split_and_join_bit_for_bit(compiled, flush_denormal):
    """join_wide/split_wide (the compiled host update's form: halves read as bf16, written
    as int32; the card's: int16) against join/split, on every remainder of masters of every
    kind: NaN with payloads, +-inf, subnormal, +-0, the largest finite, roundings that
    carry into the exponent. Compiled by Inductor (vector loops and the scalar tail: 7
    extra elements), with denormals flushed (as atom train runs) and not."""
    x = torch.cat([_all_remainders(u) for u in KINDS])
    x = torch.cat([x, x[:7]])
    hi, rem = split(x)
    fn = torch.compile(_wide, dynamic=False, fullgraph=True) if compiled else _wide
    torch.set_flush_denormal(flush_denormal)
    try:
        forms = [(hi, rem.view(torch.bfloat16))]  # the compiled host update's form
        if not compiled:
            forms.append((hi.view(torch.int16), rem))  # the card's (eager there)
        for h, r in forms:
            joined, hi32, rem32 = fn(h, r, x)
            assert hi32.dtype == rem32.dtype == torch.int32
            assert torch.equal(joined.view(torch.int32), x.view(torch.int32)), h.dtype
            got_hi, got_rem = torch.empty_like(hi), torch.empty_like(rem)
            narrow_into(hi32, rem32, got_hi, got_rem)
            assert torch.equal(got_hi.view(torch.int16), hi.view(torch.int16)), h.dtype
            assert torch.equal(got_rem, rem), h.dtype
    finally:
        torch.set_flush_denormal(True)  # as tests/conftest.py leaves it
