"""Merging with a peer that may be broken (an fp16 run that overflowed) or hostile.

What the wire validates (schema, sizes, fingerprint, finite values) does not stop a
message of finite but huge values, or an honest-looking one claiming an averaging weight
of 1e18: unguarded, `beta = w_them / (w_me + w_them)` is ~1 and the receiver takes the
sender's weights whole. Three guards, applied to every exchange in both directions:

- **beta is capped at 1/2**: a peer never weighs more than oneself, whatever sample count
  it claims (`safe_beta`).
- **outliers are refused**: a difference beyond `max_relative` times the unit's own norm
  (two independently initialised models differ by ~1.4x; 1e30 poison by ~1e29) is not
  merged; the sender is penalised, and a penalised peer is neither chosen nor served until
  its penalty ends.
- **self-centred clipping** (ClippedGossip, He et al. 2022; BTARD's CenteredClip works
  the same way), on by default (gossip.clip_factor 3): the difference `remote - mine` is
  scaled down to at most `clip` times the scale of the *other* partners' differences on
  this unit: the lower median, over every other partner, of the size (relative to the
  unit's norm) of its latest difference, in exchanges this peer started with partners it
  chose (never in requests it served: four extra ids sending requests set the scale for
  a fifth, which zeroed a member's units in 2 s). One poisoner among honest partners
  never sets its own bound and is one voice among the others, so it moves an honest peer
  at most beta x clip x (the honest partners' typical difference) per exchange. Before
  any other partner has been heard on a unit the scale is FIRST_SCALE (0.1 of the unit's
  norm): the first peer to arrive cannot take a unit whole (a sign-flipped model, right
  at max_relative, zeroed a unit that way: 26% worse val loss for its victim); under an
  outer optimizer it is how far the peer moves the unit in a period of H steps, at most
  that (merge.DiLoCoMerge.first_scale). Honest peers far apart (own inits,
  gossip.pull_state false) still meet: each judges the others by partners that are as
  far, and every exchange moves both sides. Each side clips on its own, so the group's
  mean is kept only roughly (clip_factor 0, plain averaging, keeps it exactly). A
  partner clipped k exchanges since it last came close has its beta divided by 1 + k
  (`trust`): a poisoner clipped every time fades out, an honest straggler is trusted
  again once it has come close (within CLOSE x the scale; between that and the clip
  bound trust stays as it was, except on a unit no other partner was heard on). Trust
  also divides the partner's chance to be chosen (selection.FlowSelector), and an outer
  optimizer takes no outer step on a partner it distrusts (merge.DiLoCoMerge.merge). Not
  done, measured: refusing and penalising a partner clipped 8 times in a row without
  coming twice as close also penalised an honest peer on disjoint data (its distance is
  an equilibrium, not shrinking) and cost that group 12% val loss.
  `gossip.reject_factor` (off by default) refuses, and penalises, a difference beyond
  that multiple of the scale.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from atom.gossip.net.wire import Rejected


def safe_beta(w_me: float, w_them: float) -> float:
    """The other peer's share of the pairwise mean, with its weight capped at ours."""
    w_them = min(w_them, w_me)
    return w_them / (w_me + w_them) if w_me + w_them > 0 else 0.0


FIRST_SCALE = 0.1  # the scale of a unit no other partner has been heard on
Scale = float | Callable[[], float]
CLOSE = 1.5  # a partner within this multiple of the others' scale is trusted again


class Judgement(NamedTuple):
    size: float  # |remote - mine| / |mine| before any clip
    trust: float  # the partner's trust after this judgement (DiffGuard.trust)
    typical: float  # the scale it was judged by (the yardstick: others' typical size)


class DiffGuard:
    """Per unit, the relative size |remote - mine| / |mine| of each partner's latest
    difference; `admit` clips or refuses a new one. Thread-safe (exchanges in both
    directions run on several threads). Bounded: `partners` per unit, least recent
    forgotten."""

    def __init__(
        self,
        clip: float = 0.0,
        reject: float = 0.0,
        max_relative: float = 2.0,
        partners: int = 64,
    ):
        self.clip, self.reject, self.max_relative = clip, reject, max_relative
        self.partners = partners
        self._latest: dict[int, collections.OrderedDict[str, float]] = collections.defaultdict(
            collections.OrderedDict
        )
        # partner -> exchanges it had to be clipped since it last came close (any unit)
        self._streak: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def trust(self, partner: str) -> float:
        """What a partner's beta is multiplied by: 1 / (1 + k), k its clipped exchanges
        since it last came close. A poisoner is clipped every time and fades out (a
        random-direction one cost its victims 12% val loss without this); an honest peer
        that started far is clipped while it approaches, then trusted again."""
        with self._lock:
            return 1.0 / (1 + self._streak.get(partner, 0))

    def scale(self, unit: int, partner: str, first: Scale = FIRST_SCALE) -> tuple[float, bool]:
        """(the lower median of the other partners' latest sizes on `unit`, True), or
        (`first`, False) when no other partner has been heard on it."""
        with self._lock:
            others = sorted(v for p, v in self._latest[unit].items() if p != partner)
        if not others:
            return (first() if callable(first) else first), False
        return max(others[(len(others) - 1) // 2], 1e-4), True  # floored: equal units differ

    def admit(self, unit: int, mine: torch.Tensor, diff: torch.Tensor, partner: str = "",
              first: Scale = FIRST_SCALE, record: bool = True) -> Judgement:  # fmt: skip
        """Scale `diff` (remote - mine) in place to the allowed size; the relative size it
        had, and the partner's trust as this judgement left it (read in the same lock: an
        exchange with it on another thread may be judged next). Raises
        Rejected("outlier") for one too far from the others' range. `first`:
        the scale while no other partner has been heard on the unit (the caller may know
        better than FIRST_SCALE: an outer optimizer, its own progress), or a function
        that gives it (called only then). `record` False: judged, but its size does not
        join the yardstick (a request from a peer we did not choose: any number of ids
        could send them, and their sizes would set the clip for everyone)."""
        # in float64: the squares of finite fp32 values (1e30) overflow fp32
        own = max(float(torch.linalg.vector_norm(mine, dtype=torch.float64)), 1e-12)
        size = float(torch.linalg.vector_norm(diff, dtype=torch.float64)) / own
        if not math.isfinite(size):
            raise Rejected("nonfinite", "the difference overflows")
        typical, by_others = self.scale(unit, partner, first)
        far = self.reject > 0 and size > self.reject * typical
        if size > self.max_relative or far:
            bound = (f"{self.reject:g} x the others' {typical:.3g}" if far
                     else f"{self.max_relative:g} x its own norm")  # fmt: skip
            raise Rejected("outlier", f"unit {unit} differs by {size:.3g} of its norm, "
                                      f"beyond {bound}")  # fmt: skip
        if record:
            with self._lock:
                latest = self._latest[unit]
                latest.pop(partner, None)
                latest[partner] = size
                while len(latest) > self.partners:
                    latest.popitem(last=False)
        allowed = self.clip * typical if self.clip else size
        with self._lock:
            streak = self._streak.pop(partner, 0)
            if size > allowed:
                streak += 1
            elif size <= CLOSE * typical or not self.clip or not by_others:
                streak = 0  # it came close: trusted again
            # in between it keeps the distrust it had: a random model within the bound of
            # a unit where honest peers disagree much (an embedding on disjoint data) must
            # not restore, in one exchange, the trust it lost on every other unit. Judged
            # by no other partner (a group of two) the bound is all there is: two honest
            # peers must not hold each other's distrust for good
            self._streak[partner] = streak
            while len(self._streak) > 4 * self.partners:
                self._streak.popitem(last=False)
        if size > allowed:
            diff.mul_(allowed / size)
        return Judgement(size, 1.0 / (1 + streak), typical)
