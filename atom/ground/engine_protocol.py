"""What the trainer and the peers see of an engine.

Two engines train a model: the swap engine (atom/swap/, the product: the model lives in
host memory and streams through the device) and the resident engine (atom/resident/engine.py,
plain PyTorch with the whole model on the device: the reference the tests compare
against). The trainer drives either through `Engine`; peers average what
`Engine.shared_units` hands them and never see an engine: a unit's weights as a flat fp32
vector, read, added to and written under the unit's own lock (the host optimizer and the
copies to the device take the same lock, so a merge lands between two updates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class StepResult:
    loss: float
    grad_norm: float | None
    skipped: bool = False


@dataclass(frozen=True)
class SharedUnit:
    """One unit's parameters as peers see them: `numel` fp32 values, the flat layout of
    `params` ((full name, shape) in order), behind three calls that each take the unit's
    lock: `read()` a copy, `add(delta)` master += delta, `write(values)` master = values
    (the copy that crosses the bus, and any tied alias, follow)."""

    index: int
    params: tuple[tuple[str, tuple[int, ...]], ...]
    numel: int
    read: Callable[[], torch.Tensor]
    add: Callable[[torch.Tensor], None]
    write: Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class EngineInfo:
    """How an engine trains, as the run's first line tells it."""

    mode: str  # "resident", or "swapped: N units, ..."
    pinned_bytes: int = 0  # page-locked host memory it holds
    disk: str = ""  # where the NVMe tier keeps state, and how much ("" without one)


class Engine(Protocol):
    """One optimizer step at a time over micro-batches (x, y) or (x, y, positions)."""

    device: torch.device  # where it computes
    dtype: torch.dtype  # the compute dtype there
    # True from a step's first parameter update to its end: the step can no longer stop,
    # and a second Ctrl+C waits for its end (atom/run/signals.py), or the weights would hold
    # half a step
    committed: bool

    def info(self) -> EngineInfo: ...

    def train_step(
        self, batches: list[tuple], lr: float, stop: Callable[[], bool] | None = None
    ) -> StepResult: ...

    def evaluate(self, batches: list[tuple], weights: list[float] | None = None) -> float: ...

    def named_parameters(self) -> dict[str, torch.Tensor]: ...

    def state_files(self) -> Iterator: ...

    def load_state(self, get: Callable[[str], torch.Tensor], has_optim: bool, steps: int) -> None:
        """Weights (and optimizer state, after `steps` steps) from a checkpoint, by name."""
        ...

    def optimizer_steps(self) -> int: ...

    def run_state(self) -> dict:
        """A checkpoint's small state besides tensors (meta.json): JSON values."""
        ...

    def load_run_state(self, state: dict) -> None: ...

    def shared_units(self) -> list[SharedUnit]:
        """What peers may average (ConfigError where the engine cannot share)."""
        ...

    def device_peak_bytes(self) -> int: ...

    def wait_idle(self) -> None: ...

    def close(self) -> None: ...
