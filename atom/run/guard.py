"""What a run must never do: train on, or save, weights that diverged or were poisoned.

A loss that is not finite for PATIENCE steps in a row (one such step can be an fp16
overflow the loss scaler skips; poisoned weights give one every step, which the engine
skips as non-finite gradients), or a weight not finite or beyond `train.max_abs_weight`
found before a checkpoint is written, raises TrainingError. The trainer then rolls back
to the newest checkpoint (train.py, at most MAX_ROLLBACKS times), stops mixing with every
peer merged since it was written, and goes on; with no checkpoint, or when it happens
again, the run ends with one line naming the step and the newest good checkpoint (which
was never overwritten) and a non-zero exit: a diverged fp16 run, a too-high learning
rate, or a peer that sent poison (atom/gossip/robust.py stops most of those first). A unit
whose norm gossip collapsed or blew up (atom/gossip/budget.py's alarm) is rolled back the
same way, finite or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from atom.ground.errors import TrainingError

PATIENCE = 3


def _fix(newest: Path | None) -> str:
    advice = "with a lower train.lr, or check the peers"
    if newest is None:
        return f"no checkpoint was written; start again {advice}"
    return f"{newest} is the newest checkpoint; resume from it {advice}"


class LossWatch:
    def __init__(self) -> None:
        self.bad = 0  # steps in a row whose loss was not finite

    def see(self, step: int, loss: float, newest: Callable[[], Path | None]) -> None:
        self.bad = 0 if math.isfinite(loss) else self.bad + 1
        if self.bad >= PATIENCE:
            raise TrainingError(
                f"step {step}: the loss has not been finite for {self.bad} steps ({loss}); "
                f"stopped; {_fix(newest())}"
            )


def check_weights(
    step: int, named: dict[str, torch.Tensor], limit: float, newest: Path | None
) -> None:
    """Raises TrainingError for the first weight not finite or beyond `limit`."""
    for name, t in named.items():
        top = float(t.detach().abs().max()) if t.numel() else 0.0
        if not math.isfinite(top) or top > limit:
            what = "not finite" if not math.isfinite(top) else f"{top:.3g} (limit {limit:g})"
            raise TrainingError(f"step {step}: weight {name} is {what}: not saved; {_fix(newest)}")


def gossip_alarm(step: int, alarm: str | None, newest: Callable[[], Path | None]) -> None:
    """Raises TrainingError when gossip moved a unit far more than training does
    (atom/gossip/budget.py: a norm collapsed or blown up): the trainer rolls back as for
    non-finite weights, and stops mixing with every peer merged since."""
    if alarm:
        raise TrainingError(f"step {step}: {alarm}; {_fix(newest())}")
