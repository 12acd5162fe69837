"""An fp32 master kept as its bf16 weight plus a 16-bit remainder: exact, in 4 bytes.

An fp32 number's bits are a bf16's 16 bits followed by 16 more. Keep the upper half
*rounded* (so the bf16 half is the weight the model computes with, the nearest bf16,
ties away from zero) and the lower half as a signed int16 correction, and the fp32 bits
come back exactly:

    bits(x) = (bits(hi) << 16) + rem          (int32 arithmetic, wrapping)

`rem` is the low 16 bits of x read as a signed number: in [-2^15, 2^15). Where it is
negative, the upper half was rounded up by one unit in the last place and rem takes it
back. This is TransformerEngine's FusedAdam `store_param_remainders` (from Apex), which
rounds the same way. Compared with a bf16 master plus a bf16 Kahan compensation at the
same 2 + 2 bytes, it is the fp32 master bit for bit: the update is fp32 AdamW, and a
checkpoint, a peer's merge or a resume reads the same fp32 number the fp32 state would.

`split`/`join` and their in-place forms are plain torch ops on tensors of any device
(the eager host update, checkpoints). `join_wide`/`split_wide` are the same arithmetic in
int32 alone, for the compiled update (atom/optim/compact_kernel.py): Inductor's C++
backend has no vector code for int16 (torch/_inductor/codegen/cpp.py, VECTORIZABLE_DTYPES)
and runs a whole loop that loads, stores or casts one as scalar code, ~3x slower for the
compact update. There the 16-bit halves come in as bf16 (the remainder's storage viewed
as bf16): bf16 -> fp32 is the 16 bits shifted up, exact for every pattern, NaN and
subnormal ones included; the halves go out as int32 for `narrow_into`, an eager copy after
the compiled loop (tests/test_remainder.py checks every remainder of every kind of master).
"""

from __future__ import annotations

import torch


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x -> (bf16 hi, int16 rem) with join(hi, rem) bit-equal to x; hi is x rounded
    to the nearest bf16, ties away from zero (NaN payloads aside)."""
    bits = x.view(torch.int32)
    rem = bits.to(torch.int16)  # the low 16 bits, signed (the cast keeps them)
    hi = torch.bitwise_right_shift(bits - rem.to(torch.int32), 16).to(torch.int16)
    return hi.view(torch.bfloat16), rem


def split_into(
    x: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor, tmp: torch.Tensor | None = None
) -> None:
    """split(x) written into bf16 `hi` and int16 `rem`, with `tmp` (4-byte scratch as long
    as x, any dtype) for the one temporary: the host update's passes allocate nothing."""
    bits = x.view(torch.int32)
    work = torch.empty_like(bits) if tmp is None else tmp.view(torch.int32)
    rem.copy_(bits)  # int32 -> int16 keeps the low 16 bits
    torch.sub(bits, rem, out=work).bitwise_right_shift_(16)
    hi.view(torch.int16).copy_(work)


def join_into(hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """join(hi, rem) written into fp32 `out` (returned)."""
    bits = out.view(torch.int32)
    bits.copy_(hi.view(torch.int16)).bitwise_left_shift_(16).add_(rem)
    return out


def join(hi: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16 hi, int16 rem) -> the fp32 value they split from, exactly."""
    upper = torch.bitwise_left_shift(hi.view(torch.int16).to(torch.int32), 16)
    return (upper + rem.to(torch.int32)).view(torch.float32)


def _upper(half: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bits in the upper half of int32s (lower half zero). bf16: its fp32
    conversion, which is that shift (on the CPU, vectorised and scalar alike); int16 (the
    card's form, where int16 is native): an integer widening."""
    if half.dtype == torch.bfloat16:
        return half.float().view(torch.int32)
    return torch.bitwise_left_shift(half.to(torch.int32), 16)


def join_wide(hi: torch.Tensor, rem16: torch.Tensor) -> torch.Tensor:
    """join(hi, rem) with no int16 arithmetic: `hi` the bf16 half (or its int16 view),
    `rem16` the int16 remainder viewed as bf16 (or as it is). Bit-equal to `join`."""
    rem = torch.bitwise_right_shift(_upper(rem16), 16)  # sign-extended
    return (_upper(hi) + rem).view(torch.float32)


def split_wide(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """split(x) as two int32 tensors (hi bits, rem), each in int16's range, with no int16
    arithmetic: `narrow_into` stores them. The low 16 bits sign-extended by and/xor/sub
    (a left shift of a negative int is what C++ compilers may take liberties with)."""
    bits = x.view(torch.int32)
    rem = torch.bitwise_xor(torch.bitwise_and(bits, 0xFFFF), 0x8000) - 0x8000
    return torch.bitwise_right_shift(bits - rem, 16), rem


def narrow_into(
    hi32: torch.Tensor, rem32: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor
) -> None:
    """split_wide's two int32 results into bf16 `hi` and int16 `rem` (eager int32 -> int16
    copies, which keep the low 16 bits: vectorised by ATen, ~0.2 ns an element each)."""
    hi.view(torch.int16).copy_(hi32)
    rem.copy_(rem32)
