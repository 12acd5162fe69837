"""Tensor codecs on the wire, behind one interface (encode / decode / wire_bytes).

    fp32  raw float32: exact
    bf16  raw bfloat16: half the bytes; ~3 significant digits, unbiased rounding
    int8  blockwise absmax int8 (BLOCK elements share one fp32 scale): ~0.27x the bytes.
          The averager sends a request as values and the reply as the *delta* against
          the request it answers, so the reply's rounding error scales with how far the
          two peers disagree, not with the size of the weights.
    topk  int8 where a pair of peers has no reference yet; then the k largest entries of
          the payload's difference from the pair's shared reference (int32 indices and
          blockwise int8 values): ~5 bytes per kept entry (atom/gossip/pairref.py)

Encoding always produces fresh buffers that nobody writes afterwards: they go out with
copy=False (zero-copy) and zmq may still be reading them after send returns
(FIELD_NOTES.md: never reuse a buffer before its frame is done). Decoding copies out of
the received frames into a new fp32 tensor and rejects non-finite values, wrong dtypes
and wrong sizes. Byte order is little-endian, as on every host torch supports.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from atom.gossip.net.wire import Rejected

BLOCK = 64


def _buffer(frame: Any) -> memoryview:
    """A read-only view of a received frame (zmq.Frame) or of any bytes-like object."""
    return memoryview(getattr(frame, "buffer", frame))


def _expect(metas: list[dict], dtypes: list[tuple[str, int]], codec: str) -> None:
    got = [(m["dtype"], m["n"]) for m in metas]
    if got != dtypes:
        raise Rejected("schema", f"{codec} expects tensors {dtypes}, got {got}")


class Codec:
    name = ""
    delta_replies = False  # the averager replies with the delta against the request

    def encode(self, x: torch.Tensor) -> tuple[list[dict], list[Any]]:
        """(tensor metas for the header, buffers to send) for a flat fp32 tensor. The
        buffers may share x's memory: x must not be written afterwards."""
        raise NotImplementedError

    def decode(self, metas: list[dict], frames: list, n: int) -> torch.Tensor:
        """A new flat fp32 tensor of n elements; raises Rejected on anything unexpected."""
        raise NotImplementedError

    def wire_bytes(self, n: int) -> int:
        raise NotImplementedError


class Fp32Codec(Codec):
    name = "fp32"

    def encode(self, x: torch.Tensor) -> tuple[list[dict], list[Any]]:
        # no copy: the caller hands over a tensor nobody writes again (a snapshot)
        arr = x.detach().to(torch.float32).contiguous().numpy()
        return [{"dtype": "f32", "n": arr.size}], [arr]

    def decode(self, metas: list[dict], frames: list, n: int) -> torch.Tensor:
        _expect(metas, [("f32", n)], self.name)
        out = torch.empty(n, dtype=torch.float32)
        out.numpy()[:] = np.frombuffer(_buffer(frames[0]), dtype="<f4", count=n)
        return out

    def wire_bytes(self, n: int) -> int:
        return 4 * n


class Bf16Codec(Codec):
    name = "bf16"

    def encode(self, x: torch.Tensor) -> tuple[list[dict], list[Any]]:
        arr = x.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        return [{"dtype": "bf16", "n": arr.size}], [arr]

    def decode(self, metas: list[dict], frames: list, n: int) -> torch.Tensor:
        _expect(metas, [("bf16", n)], self.name)
        raw = np.frombuffer(_buffer(frames[0]), dtype="<i2", count=n).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).float()

    def wire_bytes(self, n: int) -> int:
        return 2 * n


class Int8Codec(Codec):
    name = "int8"
    delta_replies = True

    def encode(self, x: torch.Tensor) -> tuple[list[dict], list[Any]]:
        n = x.numel()
        nb = -(-n // BLOCK)
        padded = torch.zeros(nb * BLOCK, dtype=torch.float32)
        padded[:n] = x.detach().reshape(-1)
        blocks = padded.view(nb, BLOCK)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        q_arr = q.view(-1)[:n].contiguous().numpy()
        s_arr = scale.contiguous().numpy()
        return [{"dtype": "i8", "n": n}, {"dtype": "f32", "n": nb}], [q_arr, s_arr]

    def decode(self, metas: list[dict], frames: list, n: int) -> torch.Tensor:
        nb = -(-n // BLOCK)
        _expect(metas, [("i8", n), ("f32", nb)], self.name)
        q = torch.zeros(nb * BLOCK, dtype=torch.float32)
        q[:n] = torch.from_numpy(np.frombuffer(_buffer(frames[0]), dtype=np.int8, count=n).copy())
        scale = torch.from_numpy(np.frombuffer(_buffer(frames[1]), dtype="<f4", count=nb).copy())
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise Rejected("nonfinite", "int8 block scales must be finite and >= 0")
        return (q.view(nb, BLOCK) * scale[:, None]).view(-1)[:n].clone()

    def wire_bytes(self, n: int) -> int:
        return n + 4 * (-(-n // BLOCK))


SAMPLE = 16384  # entries a threshold is estimated from (top-k of a large unit)
_PRIME = 1_000_003  # varies each sample's place inside its stretch (no RNG drawn)


def largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of about the k largest entries of `mag` (>= 0). Exact for small
    tensors; for large ones every entry at or above the (1 - k/n) quantile of a sample
    (DGC's sampled threshold, Lin et al. 2018): 3x faster than torch.topk on a
    2M-entry unit. The sample is stratified, one entry from each of SAMPLE equal
    stretches of the unit (a unit's halves can differ in scale: an embedding's rows, a
    block's matrices), at a place that varies from stretch to stretch (rows of equal
    width must not put it in one column), and deterministic: no RNG is drawn from the
    gossip threads, which would change training's. When it misses (fewer than k/2 or
    more than 2k above the threshold) the exact top-k is taken."""
    n = mag.numel()
    if n > 4 * SAMPLE and 2 * k < n:
        i = torch.arange(SAMPLE, dtype=torch.int64)
        pos = i * n // SAMPLE + (i * _PRIME) % (n // SAMPLE)
        rank = max(1, SAMPLE - round(SAMPLE * k / n))  # kthvalue counts from the smallest
        threshold = torch.kthvalue(mag[pos], rank).values
        idx = (mag >= threshold).nonzero().squeeze(1)  # in increasing order
        if k // 2 <= idx.numel() <= 2 * k:
            return idx
    return torch.topk(mag, k, sorted=False).indices.sort().values


class TopKCodec(Int8Codec):
    """Dense like int8 (encode / decode: a pair's first exchange, which sets its shared
    reference); `encode_sparse` / `decode_sparse` for the exchanges after it."""

    name = "topk"

    def __init__(self, fraction: float = 0.05):
        self.fraction = fraction

    def keep(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.fraction * n)))

    def encode_sparse(self, delta: torch.Tensor) -> tuple[list[dict], list[Any], torch.Tensor]:
        """(metas, buffers, what the receiver will decode, dense) for the k largest
        entries of `delta` by magnitude; the rest is left for a later exchange."""
        n = delta.numel()
        idx = largest(delta.abs(), self.keep(n))
        vmetas, vbufs = super().encode(delta[idx])
        vals = super().decode(vmetas, vbufs, idx.numel())
        sent = torch.zeros(n, dtype=torch.float32).index_put_((idx,), vals)
        metas = [{"dtype": "i32", "n": idx.numel()}, *vmetas]
        return metas, [idx.to(torch.int32).numpy(), *vbufs], sent

    def decode_sparse(self, metas: list[dict], frames: list, n: int) -> torch.Tensor:
        """The dense difference a sparse message carries; Rejected unless its indices are
        strictly increasing inside [0, n) and its values finite."""
        if len(metas) != 3 or metas[0]["dtype"] != "i32" or not 1 <= metas[0]["n"] <= n:
            raise Rejected("schema", f"topk expects [i32 k, i8 k, f32 k/{BLOCK}] with k <= {n}")
        k = metas[0]["n"]
        raw = np.frombuffer(_buffer(frames[0]), dtype="<i4", count=k)
        idx = torch.from_numpy(raw.astype(np.int64))
        if int(idx[0]) < 0 or int(idx[-1]) >= n or (k > 1 and not bool((idx[1:] > idx[:-1]).all())):
            raise Rejected("schema", "topk indices must be strictly increasing in [0, n)")
        vals = super().decode(metas[1:], frames[1:], k)
        return torch.zeros(n, dtype=torch.float32).index_put_((idx,), vals)

    def encode_against(self, payload: torch.Tensor, ref: torch.Tensor):
        """encode_sparse of payload - ref; the third item is what the receiver reads:
        ref + the decoded difference."""
        metas, buffers, sent = self.encode_sparse(payload - ref)
        return metas, buffers, sent.add_(ref)

    def decode_against(self, metas: list[dict], frames: list, ref: torch.Tensor) -> torch.Tensor:
        """ref + the difference a sparse message carries, checked finite."""
        return check_finite(self.decode_sparse(metas, frames, ref.numel()).add_(ref))

    def wire_bytes(self, n: int) -> int:
        """A sparse exchange's bytes (the first one of a pair is int8's)."""
        k = self.keep(n)
        return 4 * k + super().wire_bytes(k)


CODECS: dict[str, Codec] = {c.name: c for c in (Fp32Codec(), Bf16Codec(), Int8Codec(), TopKCodec())}


def get_codec(name: str, topk_fraction: float | None = None) -> Codec:
    """The codec `name`; topk with its own fraction when one is given (what we send:
    what a partner sends needs no fraction to be read)."""
    if name == "topk" and topk_fraction is not None:
        return TopKCodec(topk_fraction)
    return CODECS[name]


def check_finite(out: torch.Tensor) -> torch.Tensor:
    """`out`, or Rejected("nonfinite") if it holds NaN or Inf: the check every received
    tensor, and whatever is computed from it, must pass."""
    # one reduction instead of a boolean copy; a sum that overflows gets the full check
    if not math.isfinite(float(out.sum())) and not bool(torch.isfinite(out).all()):
        raise Rejected("nonfinite", "tensor holds NaN or Inf")
    return out


def decode_checked(codec: Codec, metas: list[dict], frames: list, n: int) -> torch.Tensor:
    """decode + the finiteness check every received tensor must pass."""
    return check_finite(codec.decode(metas, frames, n))


def roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """What the receiver of codec.encode(x) will decode: lets a sender reconstruct a reply
    that is a delta against its own (rounded) request."""
    metas, bufs = codec.encode(x)
    return codec.decode(metas, bufs, x.numel())
