"""The visit order of one optimizer step, and what follows from it.

A step is a list of visits (micro-batch, phase, unit): phase "f" runs a unit forward (the
head runs forward and backward at once), "b" runs a unit backward. Two orders:

- unit-major (`swap.order: unit`, the ATOM paper's): every micro-batch goes through a unit
  while it is loaded, so each unit's weights cross the bus once for the forward and once
  for the backward, and its gradient comes back once per step, whatever grad_accum is.
  The price is activation memory: the unit-boundary activations of all micro-batches.
- micro-batch-major (`swap.order: micro`): one micro-batch's forward and backward after
  another: one micro-batch's activations, but weights and gradients move per micro-batch.

With one micro-batch the two are the same order. Gradient "runs" are maximal stretches of
consecutive gradient-producing visits of one unit: a run accumulates on the device and
ends with one device-to-host copy. `StepState` is what a step carries along its visits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Visit:
    micro: int
    phase: str  # "f" | "b"
    unit: int


@dataclass(frozen=True)
class GradRun:
    """Where a visit stands in its unit's gradient runs (only for gradient visits)."""

    first_visit: bool  # starts a run: the device accumulator is fresh
    last_visit: bool  # ends a run: the accumulator goes to the host
    first_run: bool  # the host copies rather than adds
    last_run: bool  # the unit's gradient is final after this run
    length: int  # visits in this run (1: no device accumulation needed)


def step_order(n_units: int, n_micro: int, order: str = "unit") -> list[Visit]:
    head = n_units - 1
    if order == "unit":
        visits = [Visit(m, "f", u) for u in range(n_units) for m in range(n_micro)]
        visits += [Visit(m, "b", u) for u in range(head - 1, -1, -1) for m in range(n_micro)]
        return visits
    if order != "micro":
        raise ValueError(f"unknown order {order!r}")
    visits = []
    for m in range(n_micro):
        visits += [Visit(m, "f", u) for u in range(n_units)]
        visits += [Visit(m, "b", u) for u in range(head - 1, -1, -1)]
    return visits


def eval_order(n_units: int, n_batches: int) -> list[Visit]:
    """Evaluation: unit-major forward only, so each unit is loaded once for all batches."""
    return [Visit(b, "f", u) for u in range(n_units) for b in range(n_batches)]


def makes_grad(v: Visit, n_units: int) -> bool:
    return v.phase == "b" or v.unit == n_units - 1


def grad_runs(visits: list[Visit], n_units: int) -> dict[int, GradRun]:
    """Position -> GradRun for every gradient-producing visit."""
    positions = [i for i, v in enumerate(visits) if makes_grad(v, n_units)]
    runs: list[list[int]] = []
    for i in positions:
        if runs and runs[-1][-1] == i - 1 and visits[i - 1].unit == visits[i].unit:
            runs[-1].append(i)
        else:
            runs.append([i])
    first_of: dict[int, int] = {}
    last_of: dict[int, int] = {}
    for k, run in enumerate(runs):
        unit = visits[run[0]].unit
        first_of.setdefault(unit, k)
        last_of[unit] = k
    out: dict[int, GradRun] = {}
    for k, run in enumerate(runs):
        unit = visits[run[0]].unit
        for j, i in enumerate(run):
            out[i] = GradRun(
                first_visit=j == 0,
                last_visit=j == len(run) - 1,
                first_run=first_of[unit] == k,
                last_run=last_of[unit] == k,
                length=len(run),
            )
    return out


def prefetch_windows(visits: list[Visit], depth: int) -> list[list[int]]:
    """For each position -1 .. len-1 (index + 1 into the result): the next `depth` distinct
    units after it, i.e. what should be on the device. Built backwards in one pass."""
    windows: list[list[int]] = [[] for _ in range(len(visits) + 1)]
    ahead: list[int] = []
    for pos in range(len(visits) - 1, -1, -1):
        unit = visits[pos].unit
        ahead = [unit] + [u for u in ahead if u != unit][: depth - 1]
        windows[pos] = ahead  # the window after position pos - 1
    return windows


def load_order(visits: list[Visit], windows: list[list[int]], keep: set[int]) -> list[int]:
    """The units a step copies to the device, in the order the engine's loads start them
    (SwapEngine._advance and its visit loop; `keep`: units that stay all step once
    loaded): what the weights tier reads ahead of (atom/swap/weights.py)."""
    on: set[int] = set()
    out: list[int] = []

    def advance(pos: int, done: int | None) -> None:
        window = windows[pos + 1]
        if done is not None and done not in window and done not in keep:
            on.discard(done)
        for unit in window:
            if unit not in on:
                on.add(unit)
                out.append(unit)

    advance(-1, None)
    for pos, v in enumerate(visits):
        if v.unit not in on:
            on.add(v.unit)
            out.append(v.unit)
        advance(pos, v.unit)
    return out


@dataclass
class StepPlan:
    """Everything about a step that depends only on its shape: computed once, reused."""

    visits: list[Visit]
    runs: dict[int, GradRun]
    windows: list[list[int]]  # windows[pos + 1]: units wanted on the device after pos

    @classmethod
    def build(cls, n_units: int, n_micro: int, order: str, depth: int) -> StepPlan:
        visits = step_order(n_units, n_micro, order)
        return cls(visits, grad_runs(visits, n_units), prefetch_windows(visits, depth))

    @classmethod
    def evaluation(cls, n_units: int, n_batches: int, depth: int) -> StepPlan:
        visits = eval_order(n_units, n_batches)
        return cls(visits, {}, prefetch_windows(visits, depth))


@dataclass
class StepState:
    """What one step carries between visits, per micro-batch."""

    loss_sum: torch.Tensor
    h: dict = field(default_factory=dict)  # micro -> hidden state at the forward frontier
    targets: dict = field(default_factory=dict)  # micro -> targets, until the head
    docs: dict = field(default_factory=dict)  # micro -> Documents (packed rows) or None
    grad_h: dict = field(default_factory=dict)  # micro -> gradient at the backward frontier
    saved: dict = field(default_factory=dict)  # (unit, micro) -> checkpoint or graph
    acc: dict = field(default_factory=dict)  # unit -> (flat device gradient, its views)
