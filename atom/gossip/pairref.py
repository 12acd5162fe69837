"""The references pairs of peers share, so that an exchange can send only top-k (codec topk).

Top-k of a unit's weights would drop most of the model; top-k of how far the weights moved
from a point both ends know drops only the smallest moves. A pair's reference r is that
point: after every exchange both ends set

    r = (what the initiator's payload decoded to + what the reply decoded to) / 2

from the decoded payloads, which both ends hold bit for bit (the same elementwise fp32
arithmetic on the same inputs). The next exchange of that unit between the two sends the k
largest entries of payload - r (int32 indices, blockwise int8 values); the partner reads
r + q. Both ends then move by the difference of the two reconstructions (CHOCO-gossip's
rule, Koloskova et al. 2019), so what top-k left out stays in payload - r, whole when the
pair weighs equally, and goes out in a later exchange with that partner: the error
feedback of CHOCO-gossip and of SparseLoCo, with no buffer of its own.

A pair's first exchange of a unit is dense int8 and sets r. Each reference carries a tag,
the rid of the exchange that set it; a request names the tag it was built on. A responder
that holds another (its reply was lost or refused: it moved on, the initiator did not) or
none (it restarted, or dropped the pair) answers REF_NACK, and both drop theirs: that
exchange is skipped, the next one is dense. Whatever a partner sends is still judged whole by
the robust merge (atom/gossip/robust.py) before anything is merged: a reference is a shared
origin for compression (it holds the payloads as sent, so what a clip held back once is
offered, and judged, again in later exchanges).

Costs one fp32 copy of a unit's payload per partner that exchanged it: at most `partners`
partners are kept, the least recently used dropped whole (its next exchange is dense).
A peer that keeps no references (another codec) answers dense and says so (no `ref` in
its reply): the pair stays dense. References are not checkpointed: after a restart a
pair's next exchange is dense, and the partner replaces the reference it held.
"""

from __future__ import annotations

import collections
import threading

import torch

REF_NACK = "no shared reference"


class PairRefs:
    """partner id -> unit -> (tag, reference), bounded to `partners` partners (LRU)."""

    def __init__(self, partners: int):
        if partners < 1:
            raise ValueError(f"partners must be >= 1, got {partners}")
        self.partners = partners
        self._refs: collections.OrderedDict[str, dict[int, tuple[int, torch.Tensor]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, partner: str, unit: int, numel: int | None = None,
            ) -> tuple[int, torch.Tensor] | None:  # fmt: skip
        """(tag, reference) of the pair's unit, None if there is none (or, `numel` given,
        none of that size); the tensor is never written (a new one replaces it), so it may
        be read without the lock."""
        with self._lock:
            units = self._refs.get(partner)
            if units is None or unit not in units:
                return None
            if numel is not None and units[unit][1].numel() != numel:
                return None
            self._refs.move_to_end(partner)
            return units[unit]

    def set(self, partner: str, unit: int, tag: int, ref: torch.Tensor) -> None:
        with self._lock:
            units = self._refs.setdefault(partner, {})
            units[unit] = (tag, ref)
            self._refs.move_to_end(partner)
            while len(self._refs) > self.partners:
                self._refs.popitem(last=False)

    def drop(self, partner: str, unit: int) -> None:
        with self._lock:
            units = self._refs.get(partner)
            if units is not None:
                units.pop(unit, None)
                if not units:
                    del self._refs[partner]

    def nbytes(self) -> int:
        with self._lock:
            return sum(r.numel() * r.element_size() for u in self._refs.values()
                       for _, r in u.values())  # fmt: skip


def next_reference(request: torch.Tensor, reply: torch.Tensor) -> torch.Tensor:
    """The pair's reference after an exchange: the mean of the two decoded payloads (fp32
    addition commutes and halving is exact: both ends compute the same bits)."""
    return (request + reply).mul_(0.5)
