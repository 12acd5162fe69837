"""What a completed exchange does to a unit's fp32 master weights.

UnitParams is all the averager has of the model: the engine's shared units
(atom.engine.SharedUnit, from `Engine.shared_units()`; gossip never sees an engine), per
unit a snapshot (a copy taken under the unit's lock) and `add` (master += delta under the
lock; the copy that crosses the bus and any tied alias follow). The host optimizer and
the H2D copy thread take the same lock, so a merge lands between two optimizer updates of
the unit and never under a copy in flight.

Both strategies are *delta-preserving*: the change is computed against the snapshot we
sent, and added to whatever master holds by then, so optimizer steps taken while the
exchange was on the wire are kept, not overwritten.

    gossip  x += beta * (remote - snapshot), beta = w_remote / (w_local + w_remote):
            the weighted pairwise mean (weights = samples trained on).
    diloco  every H inner steps a unit takes an outer step: the pairwise mean is the
            target, g = outer - target is the pseudo-gradient, outer Nesterov SGD
            (m = mu m + g; outer -= lr (g + mu m)) and x = outer + local progress. Both
            ends of an exchange take the step. With lr 1, mu 0 it is plain gossip.
"""

from __future__ import annotations

import torch

from atom.engine import SharedUnit
from atom.gossip.net.wire import fingerprint


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

    def __init__(self, params: UnitParams):
        self.params = params

    step = 0

    def due(self, unit: int) -> bool:
        return True

    def reset(self) -> None:
        pass

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return {}, {}  # plain averaging keeps no state of its own

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> bool:
        return False

    def merge(self, unit: int, snap: torch.Tensor, diff: torch.Tensor, beta: float) -> None:
        """diff = remote - snap (consumed: scaled in place)."""
        self.params.add(unit, diff.mul_(beta))


class DiLoCoMerge:
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

    def due(self, unit: int) -> bool:
        return self.step - self.last_outer_step.get(unit, 0) >= self.inner_steps

    def adopt(self, unit: int, outer: torch.Tensor, momentum: torch.Tensor, step: int) -> None:
        """A joiner takes a member's outer state for a unit (after reset())."""
        self.outer[unit], self.momentum[unit], self.last_outer_step[unit] = outer, momentum, step

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

    def merge(self, unit: int, snap: torch.Tensor, diff: torch.Tensor, beta: float) -> None:
        # called with the unit claimed by exactly one exchange, so its state is ours
        target = snap + beta * diff
        g = self.outer[unit] - target  # pseudo-gradient
        m = self.momentum[unit].mul_(self.mu).add_(g)
        new_outer = self.outer[unit] - self.lr * (g + self.mu * m)
        self.params.add(unit, new_outer - snap)
        self.outer[unit] = new_outer
        self.last_outer_step[unit] = self.step


def make_merge(strategy: str, params: UnitParams, gcfg) -> GossipMerge | DiLoCoMerge:
    if strategy == "diloco":
        return DiLoCoMerge(params, gcfg.diloco_steps, gcfg.outer_lr, gcfg.outer_momentum)
    return GossipMerge(params)
