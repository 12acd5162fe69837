"""One exchange's codec work, at either end: what goes on the wire and what the partner
read of it.

An exchange is dense (fp32, bf16, int8: the whole payload) or, for a pair that shares a
reference (codec topk, pairref.py), the largest moves since that reference. Which one, the
header fields that say so (`ref`, `delta`), the int8 reply as a delta against the request,
and the pair's next reference all belong to the codec and the pair, not to the averager:
the averager asks a session to encode, to decode, and, once it merged, to commit.

    initiator                                     responder
    s = RequestSession(...)                       s = ReplySession.open(...)  (None: REF_NACK)
    metas, buffers = s.encode(mine)   -- xreq --> remote = s.decode(frames)
                                                  metas, buffers, remote = s.reply(mine, remote)
    remote = s.decode(reply)         <-- xrep --  (judged, merged) s.commit()
    (judged, merged) s.commit()

Each decode returns the partner's payload as the merge should see it: for a pair with a
reference, mine + (theirs - what they read of mine) (CHOCO-gossip's rule, pairref.py).
"""

from __future__ import annotations

from typing import Any

import torch

from atom.gossip.net.codecs import Codec, check_finite, decode_checked, roundtrip
from atom.gossip.net.wire import Rejected
from atom.gossip.pairref import PairRefs, next_reference


class RequestSession:
    """The initiator's side of one exchange of `unit` with `partner`."""

    def __init__(self, codec: Codec, refs: PairRefs, partner: str, unit: int, rid: int,
                 numel: int):  # fmt: skip
        self.codec, self.refs, self.partner, self.unit = codec, refs, partner, unit
        self.rid, self.numel = rid, numel
        # the pair's (tag, reference) to send top-k against; None: dense
        self.held = refs.get(partner, unit, numel) if codec.name == "topk" else None
        self._sent: torch.Tensor | None = None  # what the partner will read of ours
        self._mine: torch.Tensor | None = None
        self._new_ref: torch.Tensor | None = None

    @property
    def sparse(self) -> bool:
        """Top-k against a reference (judged beside the other partners' top-k exchanges)."""
        return self.held is not None

    def encode(self, mine: torch.Tensor) -> tuple[dict[str, Any], list[Any]]:
        """(header fields, buffers) of the request; `mine` is never written afterwards."""
        self._mine = mine
        fields: dict[str, Any] = {"codec": self.codec.name, "delta": False}
        if self.held is not None:
            metas, buffers, self._sent = self.codec.encode_against(mine, self.held[1])
            fields["ref"] = self.held[0]
        else:
            metas, buffers = self.codec.encode(mine)  # may share mine's memory
            # an int8 reply is a delta against exactly what the partner decoded
            self._sent = roundtrip(self.codec, mine) if self.codec.delta_replies else mine
        fields["tensors"] = metas
        return fields, buffers

    def decode(self, rh: dict, frames: list) -> torch.Tensor:
        """The reply's payload as the merge sees it; Rejected if it does not fit the
        request (the caller then abandon()s the exchange)."""
        if rh["codec"] != self.codec.name:
            raise Rejected("schema", f"answered codec {rh['codec']} to {self.codec.name}")
        # a reply to a dense request names our rid when the partner keeps a reference
        # (it trains on topk too): then so do we; a top-k reply names the request's
        kept = rh.get("ref")
        allowed = (None, self.rid) if self.codec.name == "topk" else (None,)
        if kept not in ((self.held[0],) if self.held is not None else allowed):
            raise Rejected("schema", "the reply's reference is not the request's")
        if self.held is not None:
            remote = self.codec.decode_against(rh["tensors"], frames, self.held[1])
        else:
            remote = decode_checked(self.codec, rh["tensors"], frames, self.numel)
            if rh.get("delta"):
                remote = check_finite(self._sent + remote)
        if kept is not None:
            self._new_ref = next_reference(self._sent, remote)
            remote = as_seen_from(self._mine, self._sent, remote)
        return remote

    def abandon(self) -> None:
        """The exchange was not merged: a top-k pair starts again dense."""
        if self.codec.name == "topk":
            self.refs.drop(self.partner, self.unit)

    def commit(self) -> None:
        """Merged: the pair's reference moves on (the partner's new tag is our rid)."""
        if self._new_ref is not None:
            self.refs.set(self.partner, self.unit, self.rid, self._new_ref)


class ReplySession:
    """The responder's side of one exchange; open() it from the request's header."""

    def __init__(self, codec: Codec, ours: Codec, refs: PairRefs, h: dict, unit: int,
                 numel: int, held: tuple[int, torch.Tensor] | None):  # fmt: skip
        self.codec, self.ours, self.refs, self.h = codec, ours, refs, h
        self.unit, self.numel, self.held = unit, numel, held
        self._new_ref: torch.Tensor | None = None

    @classmethod
    def open(cls, codec: Codec, ours: Codec, refs: PairRefs, h: dict, unit: int,
             numel: int) -> ReplySession | None:  # fmt: skip
        """The session for request `h` in `codec` (ours: the codec this peer trains with);
        None when the request was built on a reference we do not hold (answer REF_NACK:
        both ends drop theirs and the pair's next exchange is dense)."""
        tag = h.get("ref")
        if tag is None:
            return cls(codec, ours, refs, h, unit, numel, None)
        if codec.name != "topk":
            raise Rejected("schema", f"a reference with codec {codec.name}")
        held = refs.get(h["from"], unit, numel)
        # a new rid equal to the tag would, should the reply be lost, leave both ends on
        # one tag with two references: refused like a mismatch (rids are random: a 2^-63 chance)
        if held is None or held[0] != tag or h["rid"] == tag:
            refs.drop(h["from"], unit)
            return None
        return cls(codec, ours, refs, h, unit, numel, held)

    @property
    def sparse(self) -> bool:
        return self.held is not None

    def decode(self, frames: list) -> torch.Tensor:
        """The request's payload (checked: sizes, finite values)."""
        if self.held is not None:
            return self.codec.decode_against(self.h["tensors"], frames, self.held[1])
        return decode_checked(self.codec, self.h["tensors"], frames, self.numel)

    def reply(self, mine: torch.Tensor, remote: torch.Tensor,
              ) -> tuple[dict[str, Any], list[Any], torch.Tensor]:  # fmt: skip
        """(header fields, buffers, the request's payload as the merge sees it)."""
        codec = self.codec
        fields: dict[str, Any] = {"codec": codec.name, "delta": False}
        read = None  # what the partner will read of our reply (topk: for the reference)
        if self.held is not None:
            metas, buffers, read = codec.encode_against(mine, self.held[1])
            fields["ref"] = self.held[0]
        elif codec.delta_replies:
            # int8 replies are deltas against the request (small numbers, small rounding)
            metas, buffers = codec.encode(mine - remote)
            fields["delta"] = True
            if codec.name == "topk" and self.ours.name == "topk":  # keep a reference
                read = remote + codec.decode(metas, buffers, self.numel)
                fields["ref"] = self.h["rid"]
        else:  # fp32/bf16 replies are our payload itself, which nobody writes again
            metas, buffers = codec.encode(mine)
        fields["tensors"] = metas
        if read is not None:
            self._new_ref = next_reference(remote, read)
            remote = as_seen_from(mine, read, remote)
        return fields, buffers, remote

    def commit(self) -> None:
        """Merged: the pair's reference moves on, tagged with the request's rid."""
        if self._new_ref is not None:
            self.refs.set(self.h["from"], self.unit, self.h["rid"], self._new_ref)


def as_seen_from(mine: torch.Tensor, read: torch.Tensor, remote: torch.Tensor) -> torch.Tensor:
    """Top-k: the partner's payload as the merge should see it, mine + (remote - read),
    read = what the partner read of ours. Both ends then move by the difference of the two
    reconstructions (CHOCO-gossip's rule): the pair's sum is kept, and what top-k left out
    of either payload stays in payload - reference for a later exchange instead of being
    merged away (x - remote would pull us back towards the partner's idea of us)."""
    return remote.sub_(read).add_(mine)
