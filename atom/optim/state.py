"""What every optimizer state format shares: the names of the moments in a checkpoint, Adam's
epsilon, and the Region a format lays its cold state out in for the NVMe tier."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STATE_KEYS = ("exp_avg", "exp_avg_sq")
ADAM_EPS = 1e-8


@dataclass
class Region:
    """One contiguous run of a unit's cold state as its optimizer lays it out for the
    NVMe tier (atom/swap/disk_tier.py): `numel` elements of `dtype`, and the tensor
    objects that view it (each at an element offset, with a shape)."""

    dtype: torch.dtype
    numel: int
    views: list[tuple[torch.Tensor, int, tuple[int, ...]]] = field(default_factory=list)
