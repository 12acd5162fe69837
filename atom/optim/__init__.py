"""The optimizer update, in one place.

- `schedule`: the learning-rate schedule (`lr_at`).
- `state`: what every state format shares (moment names, Adam's epsilon, `Region`).
- `torch_adamw`: fp32 state (`swap.state: fp32`): torch's fused AdamW per unit, and the
  factory the resident reference uses, so the two stay numerically the same.
- `compact`: compact state (`swap.state: compact`), 8-bit moments; `compact_kernel` its
  whole-chunk update under torch.compile.
- `bf16`: bf16 state (`swap.state: bf16`), the bf16 weights as the master, compact's
  8-bit moments, stochastic rounding (opt in: lighter, not exact).
- `chunk_update`: one chunk of each format's update on any device (the card update).
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
