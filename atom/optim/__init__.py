"""The optimizer update, in one place.

- `schedule`: the learning-rate schedule (`lr_at`).
- `state`: what every state format shares (moment names, Adam's epsilon, `Region`).
- `torch_adamw`: fp32 state (`swap.state: fp32`): torch's fused AdamW per unit, and the
  factory the resident reference uses, so the two stay numerically the same.
- `compact`: compact state (`swap.state: compact`), 8-bit moments; `compact_kernel` its
  whole-chunk update under torch.compile.
"""

from atom.optim.schedule import lr_at
from atom.optim.state import ADAM_EPS, STATE_KEYS, Region
from atom.optim.torch_adamw import (
    TorchUnitOptimizer,
    export_state,
    init_state,
    make_optimizer,
    optimizer_step_count,
    set_lr,
)

__all__ = [
    "ADAM_EPS",
    "STATE_KEYS",
    "Region",
    "TorchUnitOptimizer",
    "export_state",
    "init_state",
    "lr_at",
    "make_optimizer",
    "optimizer_step_count",
    "set_lr",
]
