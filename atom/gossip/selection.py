"""Choosing the next partner: flow-based (mixing per second) or uniform random.

Flow-based. A pairwise average of one unit with peer j removes disagreement in
proportion to how far apart we are; with our data differing from j's, that grows with
the time since we last mixed: value_j ~ drift_j * age_j (drift_j is measured at every
exchange as relative disagreement per second; never-mixed peers get a head start so a
newcomer is mixed in quickly). The exchange costs, per GWTF's link cost (FIELD_NOTES.md)
with a push-pull's two transfers,

    d_ij = (c_i + c_j) / 2 + (lat_ij + lat_ji) + 4 * size / (bw_ij + bw_ji)

where c is each side's work per exchange (inflated by the partner's load, so a peer
everyone likes does not become a hot spot), lat the one-way latency (rtt / 2, both
ways) and bw both directions' measured bandwidth (ours, and the one j shares in its
heartbeats). A partner the robust merge clipped k times since it last came close has
its value divided by 1 + k (its trust, atom/gossip/robust.py): the disagreement a
poisoner shows is large by construction, and without this the drift would make it the
favourite partner.
Partners are drawn with probability proportional to value / cost, and with
probability `explore` uniformly: fast links are used more, yet every peer keeps mixing
with the whole group (ages grow without bound until chosen), so no peer starves and the
group cannot split into cliques.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from atom.gossip.membership import PeerState

DEFAULT_BW = 12.5e6  # bytes/s (100 Mb/s) for a link nothing is known about yet
DEFAULT_RTT = 1e-3
NEW_PEER_AGE_S = 30.0  # a never-mixed peer looks this stale: mix newcomers in early


class Selector:
    name = ""

    def choose(self, candidates: list[PeerState], unit_bytes: int) -> PeerState | None:
        raise NotImplementedError


class RandomSelector(Selector):
    """The baseline: every eligible peer equally likely (AD-PSGD style)."""

    name = "random"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, candidates: list[PeerState], unit_bytes: int) -> PeerState | None:
        return self.rng.choice(candidates) if candidates else None


class FlowSelector(Selector):
    name = "flow"

    def __init__(
        self,
        me: str,
        explore: float = 0.1,
        rng: random.Random | None = None,
        my_work: Callable[[], float] | None = None,
        trust: Callable[[str], float] | None = None,
    ):
        self.me = me
        self.explore = explore
        self.rng = rng or random.Random()
        self.my_work = my_work or (lambda: 0.0)  # seconds of our own work per exchange
        self.trust = trust or (lambda pid: 1.0)  # robust.DiffGuard.trust: 1 / (1 + k)

    def cost(self, p: PeerState, unit_bytes: int, fallback_bw: float) -> float:
        back = p.their_links.get(self.me)
        bw_ij = p.bw or None
        bw_ji = back[0] if back and back[0] > 0 else None
        bw_ij, bw_ji = bw_ij or bw_ji or fallback_bw, bw_ji or bw_ij or fallback_bw
        rtts = [r for r in (p.rtt, back[1] if back else None) if r]
        rtt = sum(rtts) / len(rtts) if rtts else DEFAULT_RTT
        c_i = self.my_work()
        c_j = p.served if p.served is not None else c_i
        utilisation = min(p.load * c_j, 0.9)  # its served exchanges/s x seconds each
        c_j = c_j / (1.0 - utilisation)  # M/M/1-style queueing at a popular peer
        return (c_i + c_j) / 2 + rtt + 4 * unit_bytes / (bw_ij + bw_ji)

    def value(self, p: PeerState, now: float, fallback_drift: float) -> float:
        if p.last_exchange is None:
            age = now - p.first_seen + NEW_PEER_AGE_S
        else:
            age = now - p.last_exchange
        drift = p.drift if p.drift is not None else fallback_drift
        # measured drift is noisy (near consensus it is mostly training noise): let it tilt
        # the choice at most 4x either way, so no peer is starved by one lucky measurement
        drift = min(max(drift, fallback_drift / 4), fallback_drift * 4)
        return max(drift, 1e-12) * max(age, 1e-3) * self.trust(p.id)

    def scores(self, candidates: list[PeerState], unit_bytes: int) -> list[float]:
        now = time.monotonic()
        bws = [p.bw for p in candidates if p.bw]
        drifts = [p.drift for p in candidates if p.drift is not None]
        fallback_bw = statistics.median(bws) if bws else DEFAULT_BW
        fallback_drift = statistics.median(drifts) if drifts else 1.0
        return [
            self.value(p, now, fallback_drift) / self.cost(p, unit_bytes, fallback_bw)
            for p in candidates
        ]

    def choose(self, candidates: list[PeerState], unit_bytes: int) -> PeerState | None:
        if not candidates:
            return None
        if len(candidates) == 1 or self.rng.random() < self.explore:
            return self.rng.choice(candidates)
        return self.rng.choices(candidates, weights=self.scores(candidates, unit_bytes))[0]


def make_selector(kind: str, me: str, explore: float, my_work=None, trust=None) -> Selector:
    if kind == "random":
        return RandomSelector()
    return FlowSelector(me, explore, my_work=my_work, trust=trust)
