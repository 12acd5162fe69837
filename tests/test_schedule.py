"""The step's visit order and what the engine derives from it (atom/swap/schedule.py).

pytest tests/test_schedule.py
"""

from __future__ import annotations

import pytest

from atom.swap.schedule import StepPlan, grad_runs, prefetch_windows, step_order


def _brute_window(visits, pos, depth):
    seen = []
    for v in visits[pos + 1 :]:
        if v.unit not in seen:
            seen.append(v.unit)
        if len(seen) == depth:
            break
    return seen


@pytest.mark.parametrize("order", ["unit", "micro"])
@pytest.mark.parametrize("n_units,n_micro", [(3, 1), (5, 3), (8, 4)])
def test_every_micro_batch_visits_every_unit_forward_then_backward(order, n_units, n_micro):
    visits = step_order(n_units, n_micro, order)
    head = n_units - 1
    assert len(visits) == n_micro * (2 * n_units - 1)
    for m in range(n_micro):
        mine = [v for v in visits if v.micro == m]
        # forward 0..head, then backward head-1..0, in that order for each micro-batch
        assert [(v.phase, v.unit) for v in mine] == [("f", u) for u in range(n_units)] + [
            ("b", u) for u in range(head - 1, -1, -1)
        ]
    if order == "unit" and n_micro > 1:  # each unit runs all micro-batches in a row
        assert [v.unit for v in visits[:n_micro]] == [0] * n_micro


@pytest.mark.parametrize("order", ["unit", "micro"])
def test_gradient_runs_send_each_unit_once_per_run(order):
    n_units, n_micro = 5, 3
    visits = step_order(n_units, n_micro, order)
    runs = grad_runs(visits, n_units)
    # every gradient visit has a run entry, nothing else does
    assert set(runs) == {i for i, v in enumerate(visits) if v.phase == "b" or v.unit == 4}
    sends = [visits[i].unit for i, r in runs.items() if r.last_visit]
    if order == "unit":  # one send per unit per step, each run as long as grad_accum
        assert sorted(sends) == list(range(n_units))
        assert all(r.length == n_micro and r.first_run and r.last_run for r in runs.values())
    else:  # one per micro-batch; only the last run makes the gradient final
        assert sorted(sends) == sorted(list(range(n_units)) * n_micro)
        finals = [visits[i] for i, r in runs.items() if r.last_run]
        assert {v.micro for v in finals} == {n_micro - 1}
        firsts = [visits[i] for i, r in runs.items() if r.first_run]
        assert {v.micro for v in firsts} == {0}


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("order", ["unit", "micro"])
def test_prefetch_windows_are_the_next_distinct_units(depth, order):
    visits = step_order(6, 3, order)
    windows = prefetch_windows(visits, depth)
    for pos in range(-1, len(visits)):
        assert windows[pos + 1] == _brute_window(visits, pos, depth), pos


def test_evaluation_loads_each_unit_once():
    plan = StepPlan.evaluation(n_units=5, n_batches=4, depth=2)
    assert plan.runs == {}
    units = [v.unit for v in plan.visits]
    assert units == sorted(units)  # unit-major: all batches through unit 0, then 1, ...
