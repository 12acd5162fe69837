"""When the swap engine runs a unit's host update, resolved once from the config, and the
run state of eager clipping.

- IMMEDIATE: no clipping and no fp16 overflow check, so no update needs the step's global
  norm: each unit updates as soon as its gradient is final, overlapping the backward.
- EXACT (`swap.update: exact`): updates wait for the global norm, then run in forward
  order, overlapping the next step's forward. Equals plain PyTorch.
- EAGER (`swap.update: eager`): each unit updates as its gradient lands, clipped by the
  previous step's norm (`EagerClip`). Not with fp16 loss scaling, which must skip a whole
  step on overflow, and an update already made cannot be skipped.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

IMMEDIATE, EXACT, EAGER = "immediate", "exact", "eager"


def resolve_timing(update: str, grad_clip: float, loss_scaling: bool) -> str:
    if grad_clip <= 0 and not loss_scaling:
        return IMMEDIATE
    if update == EAGER and loss_scaling:
        log.warning("swap.update=eager is not available with fp16 loss scaling: exact")
        return EXACT
    return EAGER if update == EAGER else EXACT


class EagerClip:
    """Eager clipping across steps: the coefficient the last finished step's global norm
    set (applied to the next step's updates), that norm (reported as the next step's
    grad_norm), and the unit updates skipped for non-finite gradients. Checkpoints carry
    `state()`: without it a resumed run would clip its first step unlike the unbroken one."""

    def __init__(self, clip: float):
        self.clip = clip
        self.coef = 1.0
        self.norm: float | None = None
        self.skipped_units = 0

    def close_step(self, norm_sq: list[float]) -> None:
        """The step's gradients have all landed: its norm sets the next step's clip."""
        total = math.sqrt(sum(norm_sq))
        self.norm = total
        if math.isfinite(total):
            self.coef = min(1.0, self.clip / (total + 1e-6))

    def state(self) -> dict:
        return {"eager_norm": self.norm, "eager_coef": self.coef}

    def load(self, state: dict) -> None:
        """Raises ValueError/TypeError for values that are not numbers (a damaged meta)."""
        norm = state.get("eager_norm")
        self.norm = None if norm is None else float(norm)
        self.coef = float(state.get("eager_coef", 1.0))
