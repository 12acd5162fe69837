"""The wire format: ZeroMQ multipart = [header, tensor frame, tensor frame, ...].

The header is a msgpack map with a fixed, versioned schema; tensor frames are raw
little-endian buffers described by the header's `tensors` list. Nothing that comes from
the network is ever unpickled: msgpack decodes only maps, lists, strings and numbers, and
every field is checked here for type and range before anything else reads it. A message
that fails any check raises Rejected(reason) and is dropped whole; the caller logs it
with the sender, counts it, and stops choosing that sender for a while.

Header fields (all messages):
    v        protocol version (PROTOCOL)
    kind     ping pong bye probe ack xreq xrep busy sreq srep nack
    group    group id (hash of the group key, or "open:" + gossip.group)
    fp       model fingerprint: hash of every unit's parameter names, shapes, dtype
    from     sender id;  inc  sender incarnation (new on every start);  ep  its endpoint
             (tcp://IP:PORT with a literal address, or "" for a client that listens nowhere)
    rid      request id: unique per sender incarnation (replays are refused, net/replay.py);
             a reply echoes its request's
    to       the id the message is for ("" only for a first ping to a seed): a message
             captured on its way to one peer is refused by every other
    step     sender's optimizer step;  samples  sequences it has trained on;  ready  joined
Per kind: unit, codec, weight, delta, served, tensors, peers, links, load, reason; a state
pull may ask for a `part` (weights, or DiLoCo's outer weights or momentum, with the
unit's `outer_step`); an exchange names its `payload` when it is not the weights
(NoLoCo's outer weights and pseudo-gradient, one tensor of twice the unit's size); a
top-k exchange names the `ref` (tag) of the pair's shared reference it is relative to; a
pong may say whether the answering member could `reach` the pinger's own endpoint.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from atom.config.gossip import CODECS, wire_endpoint

# 2: `to`, rids unique per sender; 3: a pong may say `reach`; 4: a keyed member serves
# with its own key (dialled as the name it is known by), endpoints are tcp://IP:PORT only
PROTOCOL = 4
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAMES = 8  # header + tensors; no codec needs more than 2 tensor frames
MAX_LISTED = 256  # peers / links in one heartbeat
ITEMSIZE = {"f32": 4, "bf16": 2, "i8": 1, "u8": 1, "i32": 4}
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_INT_MAX = 2**62

KINDS = {
    "ping": {"peers", "links", "load", "served"},
    "pong": {"peers", "links", "load", "served", "reach"},
    "bye": set(),
    "probe": {"tensors"},
    "ack": set(),
    "xreq": {"unit", "codec", "weight", "tensors", "delta", "payload", "ref"},
    "xrep": {"unit", "codec", "weight", "tensors", "delta", "served", "payload", "ref"},
    "busy": {"unit", "reason"},
    "sreq": {"unit", "part"},
    "srep": {"unit", "codec", "weight", "tensors", "part", "outer_step"},
    "nack": {"reason"},
}
COMMON = {"v", "kind", "group", "fp", "from", "to", "inc", "ep", "rid", "step", "samples", "ready"}
# every other field of a kind is required
OPTIONAL = {"delta", "served", "load", "reason", "part", "outer_step", "payload", "ref", "reach"}
PARTS = ("weights", "outer", "momentum")  # what a state pull asks for (DiLoCo: all three)
# what an exchange carries: the weights, or NoLoCo's [outer weights; pseudo-gradient]
PAYLOADS = ("weights", "outer")


class Rejected(Exception):
    """A message that failed validation. `reason` is a short metrics key."""

    def __init__(self, reason: str, detail: str = "", sender: str | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.sender = sender


@dataclass(frozen=True)
class Expect:
    """What this peer accepts: its group, its model, its unit count."""

    group: str
    fingerprint: str
    n_units: int


def fingerprint(units: Iterable[tuple[int, Iterable[tuple[str, tuple[int, ...]]]]]) -> str:
    """Hash of (unit index, parameter name, shape) for every owned fp32 master parameter:
    two peers average only if their flat unit buffers line up element for element."""
    h = hashlib.sha256(b"atom-fp32-master-v1")
    for index, params in units:
        h.update(f"unit {index}\n".encode())
        for name, shape in params:
            h.update(f"{name} {tuple(shape)}\n".encode())
    return h.hexdigest()[:24]


def pack(header: dict[str, Any]) -> bytes:
    data = msgpack.packb(header, use_bin_type=True)
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return data


# ------------------------------------------------------------------ field checks
def _int(value: Any, name: str, lo: int = 0, hi: int = _INT_MAX) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise Rejected("schema", f"{name} must be an int in [{lo}, {hi}]")
    return value


def _float(value: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Rejected("schema", f"{name} must be a number")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise Rejected("schema", f"{name} must be finite in [{lo}, {hi}]")
    return value


def _str(value: Any, name: str, max_len: int = 256) -> str:
    if not isinstance(value, str) or len(value) > max_len:
        raise Rejected("schema", f"{name} must be a string of at most {max_len} chars")
    return value


def _peer_id(value: Any, name: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise Rejected("schema", f"{name} must be a peer id (1-64 of A-Z a-z 0-9 _ . -)")
    return value


def _endpoint(value: Any, name: str) -> str:
    """tcp://IP:PORT and nothing else (config/gossip.py wire_endpoint): a peer list is an
    invitation to dial, so no path, host name, wildcard or port 0 is taken from the wire."""
    try:
        return wire_endpoint(_str(value, name, 64))
    except ValueError:
        raise Rejected("schema", f"{name} is not tcp://IP:PORT") from None


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise Rejected("schema", f"{name} must be a bool")
    return value


def _list(value: Any, name: str, max_len: int) -> list:
    if not isinstance(value, list) or len(value) > max_len:
        raise Rejected("schema", f"{name} must be a list of at most {max_len} items")
    return value


def _tensors(value: Any) -> list[dict[str, Any]]:
    out = []
    for i, meta in enumerate(_list(value, "tensors", MAX_FRAMES - 1)):
        if not isinstance(meta, dict) or set(meta) != {"dtype", "n"}:
            raise Rejected("schema", f"tensors[{i}] must be {{dtype, n}}")
        if meta["dtype"] not in ITEMSIZE:
            raise Rejected("schema", f"tensors[{i}].dtype must be one of {sorted(ITEMSIZE)}")
        out.append({"dtype": meta["dtype"], "n": _int(meta["n"], f"tensors[{i}].n", 0, 2**40)})
    return out


def _peers(value: Any) -> list[dict[str, Any]]:
    out = []
    for i, rec in enumerate(_list(value, "peers", MAX_LISTED)):
        if not isinstance(rec, dict) or set(rec) != {"id", "ep", "inc", "step", "ready"}:
            raise Rejected("schema", f"peers[{i}] must be {{id, ep, inc, step, ready}}")
        out.append(
            {
                "id": _peer_id(rec["id"], "peers.id"),
                "ep": _endpoint(rec["ep"], "peers.ep"),
                "inc": _int(rec["inc"], "peers.inc", 0, 2**63),
                "step": _int(rec["step"], "peers.step"),
                "ready": _bool(rec["ready"], "peers.ready"),
            }
        )
    return out


def _links(value: Any) -> list[tuple[str, float, float]]:
    out = []
    for item in _list(value, "links", MAX_LISTED):
        if not isinstance(item, list) or len(item) != 3:
            raise Rejected("schema", "links items must be [id, bytes/s, rtt s]")
        out.append(
            (
                _peer_id(item[0], "links.id"),
                _float(item[1], "links.bw", 0.0, 1e13),
                _float(item[2], "links.rtt", 0.0, 1e4),
            )
        )
    return out


_CHECKS = {
    "group": lambda v: _str(v, "group", 64),
    "fp": lambda v: _str(v, "fp", 64),
    "from": lambda v: _peer_id(v, "from"),
    "to": lambda v: "" if v == "" else _peer_id(v, "to"),
    "inc": lambda v: _int(v, "inc", 0, 2**63),
    "ep": lambda v: "" if v == "" else _endpoint(v, "ep"),  # "": a client, listening nowhere
    "rid": lambda v: _int(v, "rid", 0, 2**63),
    "step": lambda v: _int(v, "step"),
    "samples": lambda v: _int(v, "samples"),
    "ready": lambda v: _bool(v, "ready"),
    "reach": lambda v: _bool(v, "reach"),  # a pong: could we reach the pinger's endpoint?
    "unit": lambda v: _int(v, "unit", 0, 1 << 20),
    "codec": lambda v: v if v in CODECS else _fail("codec", f"unknown codec {str(v)[:20]!r}"),
    "weight": lambda v: _float(v, "weight", 1e-12, 1e18),
    "delta": lambda v: _bool(v, "delta"),
    "served": lambda v: _float(v, "served", 0.0, 1e6),
    "part": lambda v: v if v in PARTS else _fail("schema", f"part must be one of {PARTS}"),
    # negative at the start of a run: the units' outer steps are staggered (merge.py)
    "outer_step": lambda v: _int(v, "outer_step", -_INT_MAX),
    "payload": lambda v: v if v in PAYLOADS else _fail("schema", f"payload not in {PAYLOADS}"),
    "ref": lambda v: _int(v, "ref", 0, 2**63),
    "load": lambda v: _float(v, "load", 0.0, 1e6),
    "reason": lambda v: _str(v, "reason", 200),
    "tensors": _tensors,
    "peers": _peers,
    "links": _links,
}


def _fail(reason: str, detail: str):
    raise Rejected(reason, detail)


def parse_header(data: bytes | memoryview, expect: Expect) -> dict[str, Any]:
    """Decode and validate a header frame; raises Rejected."""
    if len(data) > MAX_HEADER_BYTES:
        raise Rejected("oversized", f"header of {len(data)} bytes")
    try:
        # size checked above; unpackb's own limits derive from it (no giant lists)
        raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several types on malformed input
        raise Rejected("garbage", f"header is not msgpack ({type(err).__name__})") from None
    if not isinstance(raw, dict):
        raise Rejected("garbage", "header is not a map")
    sender = raw.get("from") if isinstance(raw.get("from"), str) else None
    try:
        if raw.get("v") != PROTOCOL:
            raise Rejected("version", f"protocol {str(raw.get('v'))[:20]}, want {PROTOCOL}")
        kind = raw.get("kind")
        if kind not in KINDS:
            raise Rejected("schema", f"unknown kind {str(kind)[:20]!r}")
        allowed = COMMON | KINDS[kind]
        missing = allowed - OPTIONAL - set(raw)
        unknown = set(raw) - allowed
        if missing or unknown:
            raise Rejected("schema", f"{kind}: missing {sorted(missing)} unknown {sorted(unknown)}")
        header: dict[str, Any] = {"v": PROTOCOL, "kind": kind}
        for key, value in raw.items():
            if key not in ("v", "kind"):
                header[key] = _CHECKS[key](value)
        if header["group"] != expect.group:
            raise Rejected("group", f"group {header['group']!r} is not ours")
        if header["fp"] != expect.fingerprint:
            raise Rejected("fingerprint", "a different model (names, shapes or dtypes)")
        if "unit" in header and header["unit"] >= expect.n_units:
            raise Rejected("schema", f"unit {header['unit']} out of range")
        return header
    except Rejected as err:
        err.sender = sender
        raise


def check_frames(header: dict[str, Any], frames: list) -> None:
    """The tensor frames must match the header's `tensors` metas exactly."""
    metas = header.get("tensors", [])
    if len(frames) != len(metas):
        raise Rejected(
            "truncated", f"{len(frames)} tensor frames, header lists {len(metas)}", header["from"]
        )
    for i, (meta, frame) in enumerate(zip(metas, frames, strict=True)):
        want = meta["n"] * ITEMSIZE[meta["dtype"]]
        got = len(frame)
        if got != want:
            raise Rejected(
                "truncated", f"tensor frame {i} has {got} bytes, header says {want}", header["from"]
            )
