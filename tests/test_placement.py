"""Placement as a plan dimension: where each unit's weights live (resident on the card or
streamed) and where its update runs (swap.card_update), in the cost model and the planner.

pytest tests/test_placement.py
"""

from __future__ import annotations

import json

import pytest
import torch

from atom.config import ConfigError, load_config, replace
from atom.profiler import state_formats
from atom.profiler.analysis import ModelAnalysis, UnitInfo
from atom.profiler.cost import (
    Candidate,
    card_state_bytes,
    card_units,
    peak_device_bytes,
    predict,
)
from atom.profiler.hardware import GiB, stated
from atom.profiler.placement import format_units
from atom.profiler.planner import PLAN_VERSION, Plan
from atom.profiler.profile import run_profile
from atom.profiler.timing import estimate_pieces
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_swap_equivalence import batches_for

N = 1 << 20  # a unit of 4 blocks of 256 (compact state's block scales)
UNIT = UnitInfo(1, "blocks", 1, N, N)
SCALES = 2 * 4 * N // 256  # two fp32 scales a block of 256


@pytest.mark.parametrize(
    "state,dtype,persistent,up,down",
    [
        # fp32 state: master and both moments each way, and the compute copy down but for a
        # unit whose weights stay on the card (kept there across steps and updated there)
        ("fp32", torch.bfloat16, False, 12 * N, 14 * N),
        ("fp32", torch.bfloat16, True, 12 * N, 12 * N),
        ("fp32", torch.float32, False, 12 * N, 12 * N),
        # compact: remainder + two 8-bit moments each way, and the bf16 master down (the
        # host's copy stays current) and up, except for a unit kept on the card, whose
        # master is its slot's (issue 49: no host copy)
        ("compact", torch.bfloat16, False, 6 * N + SCALES, 6 * N + SCALES),
        ("compact", torch.bfloat16, True, 4 * N + SCALES, 4 * N + SCALES),
        # another compute dtype: the master goes up, and the compute copy comes down
        ("compact", torch.float32, True, 6 * N + SCALES, 10 * N + SCALES),
        ("compact", torch.float16, False, 6 * N + SCALES, 8 * N + SCALES),
    ],
)
def test_state_bytes_over_the_bus_per_format_and_residency(state, dtype, persistent, up, down):
    assert card_state_bytes(UNIT, state, dtype, persistent) == (up, down)


def test_without_the_engines_part_kept_units_send_their_weights_down(monkeypatch):
    """state_formats.ENGINE_CARD_WEIGHTS_STAY False: the accounting before issue 49."""
    monkeypatch.setattr(state_formats, "ENGINE_CARD_WEIGHTS_STAY", False)
    assert card_state_bytes(UNIT, "fp32", torch.bfloat16, True) == (12 * N, 14 * N)
    assert card_state_bytes(UNIT, "compact", torch.bfloat16, True) == (
        4 * N + SCALES,
        6 * N + SCALES,
    )


def test_card_units_are_written_and_read_as_swap_card_update_says():
    a = ModelAnalysis.of(tiny_config(model={"tie_embeddings": False}))
    assert format_units({1, 2, 3, 5}) == "1-3,5" and format_units(set()) == "none"
    c = Candidate(1, 1, 4, 1, True, False, card_update="1-3,5")
    assert card_units(a, c) == {1, 2, 3, 5}
    tied = ModelAnalysis.of(tiny_config())  # GPT's tied embedding and head stay on the host
    assert card_units(tied, Candidate(1, 1, 4, 1, True, False, card_update="all")) == {1, 2, 3}


def _engine_peak(cfg) -> int:
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        engine.train_step(batches_for(0, cfg), 1e-3)
        engine.train_step(batches_for(1, cfg), 1e-3)  # kept-across-steps units: loaded once
        return engine.ledger.peak
    finally:
        engine.close()


@pytest.mark.parametrize(
    "state,clip,update,accum,order,resident,card",
    [
        ("fp32", 0.0, "exact", 1, "unit", 2, "all"),
        ("compact", 1.0, "eager", 1, "unit", 2, "all"),
        ("fp32", 1.0, "exact", 1, "unit", 1, "all"),  # every card gradient waits for the norm
        ("fp32", 1.0, "eager", 2, "unit", 0, "1-3"),
        ("compact", 1.0, "eager", 2, "micro", 1, "1-4"),  # summed over the passes: all held
    ],
)
def test_memory_model_with_card_units_matches_the_engine_accounting(
    state, clip, update, accum, order, resident, card
):
    swap = {"state": state, "update": update, "order": order, "resident_units": resident,
            "card_update": card}  # fmt: skip
    cfg = tiny_config(
        model={"arch": "llama", "n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 64},
        train={"micro_batch": 2, "grad_accum": accum, "grad_clip": clip},
        swap=swap,
    )
    measured = _engine_peak(cfg)
    c = Candidate(1, 1, 2, accum, True, False, order, resident, state, False, card, update)
    predicted = peak_device_bytes(ModelAnalysis.of(cfg), c, torch.float32, cuda=False)
    assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)


def test_exact_clipping_keeps_every_card_gradient_on_the_device():
    """Exact clipping holds each card unit's fp32 gradient sum until the step's norm is
    known; eager (and no clipping) one at a time."""
    cfg = load_config("llama-1b")
    a = ModelAnalysis.of(cfg)
    card = {u.index for u in a.units}
    sums = sum(4 * a.units[i].n_total for i in card)
    peaks = {}
    for update in ("exact", "eager"):
        c = Candidate(1, 1, 1, 1, True, False, resident_units=4, state="compact",
                      card_update=format_units(card), update=update)  # fmt: skip
        peaks[update] = peak_device_bytes(a, c, torch.bfloat16, cuda=True)
    largest = max(4 * u.n_total for u in a.units)
    assert peaks["exact"] - peaks["eager"] >= (sums - 2 * largest) * 0.9
    no_clip = replace(cfg, train={"grad_clip": 0.0})  # exact needs a norm only to clip
    c = Candidate(1, 1, 1, 1, True, False, state="compact", card_update="all")
    assert peak_device_bytes(ModelAnalysis.of(no_clip), c, torch.bfloat16, True) < peaks["exact"]


def test_units_kept_on_the_card_cross_the_bus_only_as_state():
    """A resident unit updated on the card never reloads: no weights up, its state up and
    down (its weights stay on the card: none down); a resident unit updated on the host
    still loads once a step."""
    cfg = load_config("llama-1b")
    a = ModelAnalysis.of(cfg)
    hw = stated("rtx4090")
    times = estimate_pieces(a, 1, hw)
    host = Candidate(1, 1, 1, 1, True, False, resident_units=4, state="compact")
    card = Candidate(1, 1, 1, 1, True, False, resident_units=4, state="compact",
                     card_update=format_units({u.index for u in a.units[-5:-1]}))  # fmt: skip
    p_host = predict(a, host, hw, times, torch.bfloat16)
    p_card = predict(a, card, hw, times, torch.bfloat16)
    kept = sum(u.n_total for u in a.units[-5:-1])
    assert p_host.detail["h2d_bytes_per_step"] - p_card.detail["h2d_bytes_per_step"] == 2 * kept
    assert p_card.detail["state_up_bytes"] == pytest.approx(kept * (4 + 8 / 256), rel=1e-3)
    # down, the same: the weights stay on the card (issue 49)
    assert p_card.detail["state_down_bytes"] == p_card.detail["state_up_bytes"]
    assert p_host.detail["d2h_grad_bytes_per_step"] - p_card.detail["d2h_grad_bytes_per_step"] == (
        2 * kept
    )
    assert p_card.detail["card_update_device_s"] == pytest.approx(kept * 24 / 1008e9)


def test_an_old_plan_is_refused_in_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": 2, "swap": {}}))
    with pytest.raises(ConfigError, match=r"plan.json was written by an older atom: run atom "
                       "profile again$"):  # fmt: skip
        Plan.load(path)


def test_a_plan_with_card_units_trains(tmp_path):
    """A tiny model on a stated card whose host update binds: the plan updates on the card,
    its swap section is one the engine accepts, and a step runs with it."""
    cfg = tiny_config(model={"arch": "llama", "n_layer": 4}, train={"grad_clip": 1.0})
    plan, ranked, _ = run_profile(cfg, stated="rtx4090", gpu_mem=GiB, host_mem=GiB,
                                  progress=False)  # fmt: skip
    assert plan.swap["card_update"] != "none" and plan.swap["update"] in ("exact", "eager")
    assert any("clipping" in note for note in plan.notes)
    plan.save(tmp_path / "plan.json")
    trained = Plan.load(tmp_path / "plan.json").apply(cfg)
    assert trained.swap.card_update == plan.swap["card_update"]
    assert trained.swap.update == plan.swap["update"]
    engine = SwapEngine(trained, CpuBackend(), torch.float32)
    try:
        assert engine.card_units
        assert engine.train_step(batches_for(0, trained), 1e-3).loss > 0
    finally:
        engine.close()


def test_greedy_placement_keeps_what_fits_and_says_why():
    """Llama 1B at 2 sequences a step (the host's update binds) on a stated 4090 cut to
    3 GiB: some block units fit on the card (kept there and updated there), the rest are
    streamed; each group is named and explained."""
    cfg = load_config("llama-1b")
    plan, ranked, _ = run_profile(cfg, 2, 3 * GiB, 64 * GiB, "rtx4090", progress=False)
    lpu = plan.swap["layers_per_unit"]
    n_blocks = -(-cfg.model.n_layer // lpu)
    k = plan.swap["resident_units"]
    assert 0 < k < n_blocks
    card = card_units(ModelAnalysis.of(replace(cfg, swap={"layers_per_unit": lpu})),
                      ranked[0].candidate)  # fmt: skip
    assert n_blocks in card  # the resident unit nearest the head is updated on the card
    groups = {(g["weights"], g["update"]): g for g in plan.placement}
    kept = groups[("resident", "card")]
    assert "weights stay on the card across steps, updated on the card" in kept["says"]
    streamed = [g for g in plan.placement if g["weights"] == "streamed"]
    assert any("no room to keep more units" in g["why"] for g in streamed)
    assert all(r.prediction.peak_device_bytes <= 3 * GiB for r in ranked)
    # more card memory keeps more units
    roomy, _, _ = run_profile(cfg, 2, 24 * GiB, 64 * GiB, "rtx4090", progress=False)
    assert roomy.swap["resident_units"] * roomy.swap["layers_per_unit"] > k * lpu


def test_the_profile_prints_where_each_unit_lives(tmp_path, capsys):
    from atom.cli import main

    out = tmp_path / "plan.json"
    assert main(["profile", "--config", "llama-1b", "--hardware", "rtx4090", "--host-mem",
                 "64GiB", "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["version"] == PLAN_VERSION and saved["placement"]
    for group in saved["placement"]:
        assert f"atom: {group['says']}\n        because {group['why']}" in printed
    assert "clipping (train.grad_clip" in printed


def test_card_update_with_the_nvme_tier_but_not_another_optimizer():
    """The NVMe tier pages a card update's state as a host update's (issue 43): plans on
    the tier may update on the card; DeepSpeed's optimizer runs on the host only."""
    cfg = load_config("llama-7b")
    plan, ranked, _ = run_profile(cfg, stated="rtx4090", host_mem=32 * GiB, progress=False)
    assert plan.disk_tier
    assert any(r.candidate.disk_tier and r.candidate.card_update != "none" for r in ranked)
    ds = replace(load_config("llama-1b"), train={"optimizer": "deepspeed"}, swap={"state": "fp32"})
    _, ranked, _ = run_profile(ds, stated="rtx4090", host_mem=64 * GiB, progress=False)
    assert all(r.candidate.card_update == "none" for r in ranked)
