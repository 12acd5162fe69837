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

Both functions are plain torch ops on tensors of any device (the host update, the card
update, checkpoints), and trace under torch.compile.
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
