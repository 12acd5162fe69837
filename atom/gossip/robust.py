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
- **self-centred clipping** (ClippedGossip, He et al. 2022; BTARD's CenteredClip works the
  same way), on by default (gossip.clip_factor 3): the difference `remote - mine` is
  scaled down to at most `clip` times the median of the differences this unit accepted
  recently (from every partner), relative to the unit's norm. A poisoner then moves an
  honest peer at most beta x clip x (the group's typical difference) per exchange, and
  honest peers far apart (own inits, gossip.pull_state false) still meet: each exchange
  moves them that far towards each other. Each side clips on its own, so the group's mean
  is kept only roughly (plain averaging, clip_factor 0, keeps it exactly).
  `gossip.reject_factor` (off by default) refuses, and penalises, a difference beyond
  that multiple of the median: with 30x, a peer that started from its own init was
  refused for good once the others had converged (one median per unit mixes partners at
  very different distances).
"""

from __future__ import annotations

import collections
import math
import threading

import torch

from atom.gossip.net.wire import Rejected


def safe_beta(w_me: float, w_them: float) -> float:
    """The other peer's share of the pairwise mean, with its weight capped at ours."""
    w_them = min(w_them, w_me)
    return w_them / (w_me + w_them) if w_me + w_them > 0 else 0.0


class DiffGuard:
    """Per unit, the recent relative sizes |remote - mine| / |mine| of accepted
    differences; `admit` clips or refuses a new one. Thread-safe (exchanges in both
    directions run on several threads)."""

    def __init__(
        self,
        clip: float = 0.0,
        reject: float = 0.0,
        max_relative: float = 2.0,
        history: int = 32,
        warmup: int = 4,
    ):
        self.clip, self.reject, self.max_relative = clip, reject, max_relative
        self.warmup = warmup
        self._recent: dict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=history)
        )
        self._lock = threading.Lock()

    def admit(self, unit: int, mine: torch.Tensor, diff: torch.Tensor) -> float:
        """Scale `diff` (remote - mine) in place to the allowed size; the relative size it
        had. Raises Rejected("outlier") for one too far from the group's recent range."""
        # in float64: the squares of finite fp32 values (1e30) overflow fp32
        own = max(float(torch.linalg.vector_norm(mine, dtype=torch.float64)), 1e-12)
        size = float(torch.linalg.vector_norm(diff, dtype=torch.float64)) / own
        if not math.isfinite(size):
            raise Rejected("nonfinite", "the difference overflows")
        with self._lock:
            recent = sorted(self._recent[unit])
            typical = None
            if len(recent) >= self.warmup:  # floored: units equal so far have median 0
                typical = max(recent[len(recent) // 2], 1e-4)
            far = typical is not None and self.reject > 0 and size > self.reject * typical
            if size > self.max_relative or far:
                bound = (f"{self.reject:g} x the recent median {typical:.3g}" if far
                         else f"{self.max_relative:g} x its own norm")  # fmt: skip
                raise Rejected("outlier", f"unit {unit} differs by {size:.3g} of its norm, "
                                          f"beyond {bound}")  # fmt: skip
            # what is merged is what is remembered: a run of near-outliers, each clipped,
            # cannot walk the median up
            allowed = self.clip * typical if typical and self.clip else size
            self._recent[unit].append(min(size, allowed))
        if size > allowed:
            diff.mul_(allowed / size)
        return size
