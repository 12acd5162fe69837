"""What a completed exchange does to a unit's fp32 master weights.

UnitParams is all the averager has of the model: the engine's shared units
(atom.ground.engine_protocol.SharedUnit, from `Engine.shared_units()`; gossip never sees an
engine), per unit a snapshot (a copy taken under the unit's lock) and `add` (master +=
delta under the lock; the copy that crosses the bus and any tied alias follow). The host
optimizer and the H2D copy thread take the same lock, so a merge lands between two
optimizer updates of the unit and never under a copy in flight.

Both strategies are *delta-preserving*: the change is computed against the snapshot we
sent, and added to whatever master holds by then, so optimizer steps taken while the
exchange was on the wire are kept, not overwritten.

    gossip  x += beta * (remote - snapshot), beta = w_remote / (w_local + w_remote):
            the weighted pairwise mean (weights = samples trained on).
    diloco  every H inner steps a unit takes an outer step: the pairwise mean is the
            target, g = outer - target is the pseudo-gradient, outer Nesterov SGD
            (m = mu m + g; outer -= lr (g + mu m)) and x = outer + local progress. Both
            ends of an exchange take the step. With lr 1, mu 0 it is plain gossip.
    noloco  DiLoCo's schedule, NoLoCo's split (Kolehmainen et al. 2025): an exchange
            carries each end's outer weights phi and pseudo-gradient d = phi - x, so the
            two are told apart: the momentum sees only the pair's mean pseudo-gradient,
            the outer weights are pulled to the pair's mean without it:
                d' = (1-b) d_i + b d_j;  m = mu m + d'
                phi_i += -lr (d' + mu m) + gamma b (phi_j - phi_i)
            With lr 1, mu 0, gamma 1 it is plain gossip. In DiLoCo's rule the momentum
            also carries the disagreement between the two ends, and with frequent outer
            steps it oscillates (docs/benchmarks.md "The outer optimizer").

An exchange's payload is the unit's weights (gossip, diloco) or [phi; d] (noloco):
`payload()` makes ours, `weights_of()` reads a partner's weights out of theirs. The robust
merge judges the whole payload's difference from ours (atom/gossip/averager.py `_judge`).
Under diloco and noloco an exchange with a partner the robust merge distrusts (trust
below 1, atom/gossip/robust.py) is no outer step: it is averaged in plainly, weights and
outer weights alike, out of the momentum, and the unit comes due again in H / 4 steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from atom.gossip.net.wire import fingerprint
from atom.gossip.robust import FIRST_SCALE
from atom.ground.engine_protocol import SharedUnit

MIN_INTERVAL_S = 0.01  # plain averaging's period, per unit, however small interval_s is


class UnitParams:
    """The shared units that own parameters, by index."""

    def __init__(self, shared: list[SharedUnit]) -> None:
        self.shared = shared
        self.n_units = len(shared)
        # the tied head owns nothing but its final norm; a unit owning nothing is skipped
        self.units = [s.index for s in shared if s.numel > 0]
        self.fingerprint = fingerprint((s.index, list(s.params)) for s in shared)

    def numel(self, unit: int) -> int:
        return self.shared[unit].numel

    def total_numel(self) -> int:
        return sum(self.numel(u) for u in self.units)

    def snapshot(self, unit: int) -> torch.Tensor:
        return self.shared[unit].read()

    def add(self, unit: int, delta: torch.Tensor) -> None:
        self.shared[unit].add(delta)

    def load(self, unit: int, values: torch.Tensor) -> None:
        self.shared[unit].write(values)


def relative_disagreement(local: torch.Tensor, diff: torch.Tensor) -> float:
    """|remote - local|^2 / |local|^2: scale-free, comparable across units."""
    return float(torch.dot(diff, diff)) / max(float(torch.dot(local, local)), 1e-20)


class GossipMerge:
    name = "gossip"
    payload_kind = "weights"  # what an exchange carries (the header's `payload`)

    def __init__(self, params: UnitParams):
        self.params = params

    step = 0

    def payload_numel(self, n: int) -> int:
        return n

    def payload(self, unit: int, snap: torch.Tensor) -> torch.Tensor:
        """What we send for `unit`, given its snapshot (never written afterwards)."""
        return snap

    def weights_of(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """The sender's weights in a payload (may be the payload itself)."""
        return payload

    def due(self, unit: int) -> bool:
        return True

    def servable(self, unit: int) -> bool:
        """Whether a partner's request for `unit` may be served now by the schedule."""
        return True

    def schedule(self, interval_s: float, n_units: int) -> tuple[Callable[[], float], float]:
        """(the schedule's clock, one period in its units): how often one partner may
        exchange a unit with us (atom/gossip/budget.py). Plain averaging: the seconds our
        own lanes take to start one exchange of every unit."""
        return time.monotonic, max(interval_s, MIN_INTERVAL_S) * max(n_units, 1)

    def first_scale(self, unit: int, snap: torch.Tensor) -> float:
        """The robust merge's scale for a unit no other partner has been heard on."""
        return FIRST_SCALE

    def reset(self) -> None:
        pass

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return {}, {}  # plain averaging keeps no state of its own

    # a unit's state besides its weights, by part: what a member serves a joiner (sreq
    # `part`) and the joiner adopts after reset()
    state_parts: tuple[str, ...] = ()

    def state_part(self, unit: int, part: str) -> tuple[torch.Tensor, dict]:
        """(a copy of the part's values, header fields that go with it)."""
        raise KeyError(part)

    def adopt(self, unit: int, parts: dict[str, tuple[torch.Tensor, dict]]) -> None:
        """A joiner takes a member's parts of a unit (each as state_part gave them)."""

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> bool:
        return False

    def merge(self, unit: int, snap: torch.Tensor, diff: torch.Tensor, beta: float,
              remote: torch.Tensor | None = None, clipped: bool = False) -> None:  # fmt: skip
        """diff = remote weights - snap (consumed: scaled in place); remote = the partner's
        payload, moved towards ours as far as the robust merge clipped diff; clipped: the
        robust merge shrank this partner's differences lately (a partner not to build on)."""
        self.params.add(unit, diff.mul_(beta))


FIRST_FLOOR = 0.01  # an outer optimizer's first scale, just after a reset (no progress yet)
SERVE_EARLY = 0.5  # a unit is served from this share of its period before it is due


class DiLoCoMerge(GossipMerge):
    """Decentralised DiLoCo. Costs two fp32 copies of the model (outer weights, momentum)."""

    name = "diloco"

    def __init__(self, params: UnitParams, inner_steps: int, lr: float, momentum: float):
        self.params = params
        self.inner_steps = inner_steps
        self.lr = lr
        self.mu = momentum
        self.outer: dict[int, torch.Tensor] = {}
        self.momentum: dict[int, torch.Tensor] = {}
        self.last_outer_step: dict[int, int] = {}
        # how far the unit had moved (relative to its norm) when it took its last outer
        # step: what an H-step period of training moves it (first_scale)
        self.period_move: dict[int, float] = {}
        self.step = 0  # the trainer's step, set by the peer after every optimizer step
        self.reset()

    def reset(self) -> None:
        """The current weights become the outer weights (at start, and after a join pull).

        The units' schedules are staggered (Streaming DiLoCo's fragments): unit k of n
        takes its first outer step H (n - k) / n steps from now, so outer steps, and the
        bytes they move, are spread evenly over every H steps instead of arriving all at
        once."""
        units = self.params.units
        for k, u in enumerate(units):
            self.outer[u] = self.params.snapshot(u)
            self.momentum[u] = torch.zeros_like(self.outer[u])
            self.last_outer_step[u] = self.step - self.inner_steps * k // len(units)
            self.period_move[u] = 0.0

    def _since(self, unit: int) -> int:
        """Our steps since the unit's last outer step."""
        return self.step - self.last_outer_step.get(unit, 0)

    def due(self, unit: int) -> bool:
        return self._since(unit) >= self.inner_steps

    def servable(self, unit: int) -> bool:
        """Due, or within SERVE_EARLY of a period of it: a partner a little ahead of us
        (faster, or a peer that took the unit's last step with someone else) is served;
        an outer step on request every few steps is not."""
        return self._since(unit) >= self.inner_steps * (1 - SERVE_EARLY)

    def schedule(self, interval_s: float, n_units: int) -> tuple[Callable[[], float], float]:
        """Our own optimizer steps; a period is H of them."""
        return (lambda: float(self.step)), float(self.inner_steps)

    def first_scale(self, unit: int, snap: torch.Tensor) -> float:
        """How far this peer moves the unit in a period of H steps (relative to its norm:
        since its last outer step, or over the period before it, whichever is more),
        floored at FIRST_FLOOR, at most FIRST_SCALE: an honest partner differs by about
        as much (it made as many steps from a nearby outer point), while 10% of the norm
        let a poisoner arriving first on a unit, as it does every H steps with the outer
        schedule, move it far more than an outer step does. The period before counts so
        that a peer that just took an outer step does not judge the next partner by the
        few steps since (in a group of two, every partner is a first voice)."""
        moved = self._moved(unit, snap)
        return min(FIRST_SCALE, max(moved, self.period_move.get(unit, 0.0), FIRST_FLOOR))

    def _moved(self, unit: int, snap: torch.Tensor) -> float:
        own = max(float(torch.linalg.vector_norm(snap, dtype=torch.float64)), 1e-12)
        return float(torch.linalg.vector_norm(self.outer[unit] - snap, dtype=torch.float64)) / own

    def _not_an_outer_step(self, unit: int, step: torch.Tensor) -> None:
        """A partner the robust merge shrank lately: `step` (beta x its difference) is
        averaged in plainly, weights and outer weights alike (the local progress between
        them unchanged), and kept out of the momentum, which would carry it on for several
        outer steps. The unit comes due again in H / 4 steps, for another partner most
        likely: soon, yet not at the gossip's full rate while every partner is distrusted."""
        self.params.add(unit, step)
        self.outer[unit] = self.outer[unit] + step
        retry = self.step - self.inner_steps + max(1, self.inner_steps // 4)
        self.last_outer_step[unit] = max(self.last_outer_step.get(unit, retry), retry)

    def _outer_step_taken(self, unit: int, snap: torch.Tensor, new_outer: torch.Tensor) -> None:
        self.period_move[unit] = self._moved(unit, snap)
        self.params.add(unit, new_outer - snap)
        self.outer[unit] = new_outer
        self.last_outer_step[unit] = self.step

    state_parts = ("outer", "momentum")  # the outer optimizer, so a joiner takes it too

    def state_part(self, unit: int, part: str) -> tuple[torch.Tensor, dict]:
        values = {"outer": self.outer, "momentum": self.momentum}[part][unit].clone()
        return values, {"outer_step": self.last_outer_step.get(unit, 0)}

    def adopt(self, unit: int, parts: dict[str, tuple[torch.Tensor, dict]]) -> None:
        """A joiner takes a member's outer state for a unit (after reset())."""
        (outer, fields), (momentum, _) = parts["outer"], parts["momentum"]
        self.outer[unit], self.momentum[unit] = outer, momentum
        self.last_outer_step[unit] = int(fields.get("outer_step", 0))

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """For a checkpoint: the outer weights and momentum per unit (copies: merges may
        run meanwhile), and each unit's last outer step. Names start with "optim.": it is
        optimizer state, not the model's."""
        tensors = {}
        for u in self.params.units:
            tensors[f"optim.outer.{u}.weights"] = self.outer[u].clone()
            tensors[f"optim.outer.{u}.momentum"] = self.momentum[u].clone()
        return tensors, {"last_outer_step": {str(u): s for u, s in self.last_outer_step.items()}}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> bool:
        """What state() saved, if it is all there and fits; False (state unchanged)
        otherwise, e.g. a checkpoint of a run that averaged plainly."""
        steps = meta.get("last_outer_step") if isinstance(meta, dict) else None
        if not isinstance(steps, dict):
            return False
        loaded = {}
        for u in self.params.units:
            w = tensors.get(f"optim.outer.{u}.weights")
            m = tensors.get(f"optim.outer.{u}.momentum")
            n = self.params.numel(u)
            if w is None or m is None or w.numel() != n or m.numel() != n:
                return False
            if not isinstance(steps.get(str(u)), int):
                return False
            loaded[u] = (
                w.reshape(-1).float().clone(),
                m.reshape(-1).float().clone(),
                steps[str(u)],
            )
        for u, (w, m, s) in loaded.items():
            self.outer[u], self.momentum[u], self.last_outer_step[u] = w, m, s
        return True

    def merge(self, unit: int, snap: torch.Tensor, diff: torch.Tensor, beta: float,
              remote: torch.Tensor | None = None, clipped: bool = False) -> None:  # fmt: skip
        # called with the unit claimed by exactly one exchange, so its state is ours
        if clipped:
            self._not_an_outer_step(unit, diff.mul_(beta))
            return
        target = snap + beta * diff
        g = self.outer[unit] - target  # pseudo-gradient
        m = self.momentum[unit].mul_(self.mu).add_(g)
        self._outer_step_taken(unit, snap, self.outer[unit] - self.lr * (g + self.mu * m))


class NoLoCoMerge(DiLoCoMerge):
    """DiLoCo's state and schedule; the exchange carries [phi; d] and the rule keeps the
    pair's disagreement out of the momentum (module docstring)."""

    name = "noloco"
    payload_kind = "outer"

    def __init__(self, params: UnitParams, inner_steps: int, lr: float, momentum: float,
                 consensus: float):  # fmt: skip
        self.gamma = consensus
        super().__init__(params, inner_steps, lr, momentum)

    def payload_numel(self, n: int) -> int:
        return 2 * n

    def payload(self, unit: int, snap: torch.Tensor) -> torch.Tensor:
        outer = self.outer[unit]
        return torch.cat([outer, outer - snap])

    def weights_of(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return payload[:n] - payload[n:]

    def merge(self, unit: int, snap: torch.Tensor, diff: torch.Tensor, beta: float,
              remote: torch.Tensor | None = None, clipped: bool = False) -> None:  # fmt: skip
        if remote is None:
            raise ValueError("noloco merges need the partner's payload")
        n = snap.numel()
        outer = self.outer[unit]
        if clipped:  # as DiLoCo's: its pseudo-gradient must not reach our momentum later
            self._not_an_outer_step(unit, diff.mul_(beta))
            return
        mine_d = outer - snap
        d = mine_d.add_(remote[n:] - mine_d, alpha=beta)  # the pair's pseudo-gradient
        m = self.momentum[unit].mul_(self.mu).add_(d)
        new_outer = outer - self.lr * (d + self.mu * m)
        new_outer.add_(remote[:n] - outer, alpha=self.gamma * beta)
        self._outer_step_taken(unit, snap, new_outer)


# outer learning rate and momentum when the config leaves them unset, per strategy.
# DiLoCo's paper uses 0.7 / 0.9 at H = 500; with H 10-100 on short runs that momentum
# overshoots (worse than no gossip at H 10), 1.0 / 0.5 was the best measured
# (docs/benchmarks.md "The outer optimizer")
OUTER_DEFAULTS = {"diloco": (1.0, 0.5), "noloco": (1.0, 0.5)}


def make_merge(strategy: str, params: UnitParams, gcfg) -> GossipMerge | DiLoCoMerge:
    if strategy not in OUTER_DEFAULTS:
        return GossipMerge(params)
    lr, mu = OUTER_DEFAULTS[strategy]
    lr = lr if gcfg.outer_lr is None else gcfg.outer_lr
    mu = mu if gcfg.outer_momentum is None else gcfg.outer_momentum
    if strategy == "noloco":
        return NoLoCoMerge(params, gcfg.diloco_steps, lr, mu, gcfg.outer_consensus)
    return DiLoCoMerge(params, gcfg.diloco_steps, lr, mu)
