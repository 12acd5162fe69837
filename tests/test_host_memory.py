"""Issue 49's honest cost model: host memory traffic charged, the bf16 state priced, the
weights of units kept and updated on the card counted on the card only, and the link
measured both ways at once (over the fake CUDA).

    pytest tests/test_host_memory.py
"""

from __future__ import annotations

import json

import pytest
import torch

from atom.config import ConfigError
from atom.optim.compact import BLOCK, CHUNK, SCRATCH_BUFFERS, padded
from atom.profiler import bandwidth, state_formats
from atom.profiler.analysis import ModelAnalysis, UnitInfo
from atom.profiler.cost import Candidate, host_bytes, predict
from atom.profiler.hardware import PRESETS, stated
from atom.profiler.profile import run_profile
from atom.profiler.state_formats import card_state_bytes, moment_bytes
from atom.profiler.timing import estimate_pieces
from tests.conftest import tiny_config
from tests.fake_cuda import install

N = 1 << 20
UNIT = UnitInfo(1, "blocks", 1, N, N)
SCALES = 2 * 4 * N // 256


def _untied():
    return tiny_config(model={"tie_embeddings": False})


def _plan(state: str, hw=None) -> tuple[ModelAnalysis, Candidate, object]:
    """Blocks 2-3 kept on the card across steps and updated there; the embedding, block 1
    and the head streamed and updated on the host."""
    a = ModelAnalysis.of(_untied())
    hw = hw or stated("rtx4090")
    c = Candidate(1, 1, 4, 1, True, False, "unit", resident_units=2, state=state,
                  card_update="2-3", update="eager")  # fmt: skip
    return a, c, hw


def test_host_dram_bytes_are_the_plans_own_byte_counts_by_hand():
    """Compact state, bf16 compute: weights up (the forward loads the units not kept across
    steps, the backward reloads those the prefetch did not keep), gradients down in bf16
    (a DMA write, then the landing reads the staging pool and writes the host gradient),
    the host update's 16 + 16/256 bytes a parameter, the card units' remainder and moments
    up once and down once (DMA straight into their page-locked place), nothing else."""
    a, c, hw = _plan("compact")
    p = predict(a, c, hw, estimate_pieces(a, 4, hw), torch.bfloat16)
    n = [u.n_total for u in a.units]
    host = (0, 1, 4)
    weights = 2 * (n[0] + n[1] + n[4]) + 2 * (n[1] + n[0])  # unit 3 stays from the forward
    grads = 2 * sum(n[i] for i in host)
    landing = (2 + 2) * sum(n[i] for i in host)
    update = (16 + 16 / BLOCK) * sum(a.units[i].n_owned for i in host)
    card = sum(2 * (2 * n[i] + moment_bytes(n[i])) for i in (2, 3))
    want = weights + grads + landing + update + card
    d = p.detail
    assert d["h2d_bytes_per_step"] == weights and d["d2h_grad_bytes_per_step"] == grads
    assert d["state_up_bytes"] == d["state_down_bytes"] == card / 2  # no weights either way
    assert d["host_dram_bytes"] == pytest.approx(want, rel=1e-12)
    assert d["host_dram_s"] == pytest.approx(want / hw.host_mem_bps)


def test_a_step_is_never_shorter_than_its_host_memory_traffic():
    a, c, hw = _plan("compact")
    times = estimate_pieces(a, 4, hw)
    fast = predict(a, c, hw, times, torch.bfloat16)
    assert fast.bottleneck != "host memory" and fast.step_s == fast.detail["pipeline_s"]
    hw.host_mem_bps = fast.detail["host_dram_bytes"] / (3 * fast.step_s)
    slow = predict(a, c, hw, times, torch.bfloat16)
    assert slow.bottleneck == "host memory"
    assert slow.step_s == pytest.approx(3 * fast.step_s)
    assert slow.detail["pipeline_s"] == fast.step_s
    hw.host_mem_bps = 0.0  # unknown: not charged
    assert predict(a, c, hw, times, torch.bfloat16).step_s == fast.step_s


def test_the_profile_says_when_host_memory_binds_and_keeps_its_bytes(tmp_path):
    spec = {**PRESETS["rtx4090"], "host_mem_bps": 1e6}
    path = tmp_path / "slow-ram.json"
    path.write_text(json.dumps(spec))
    plan, _, _ = run_profile(_untied(), target_batch=4, stated=str(path), progress=False,
                             rivals=False)  # fmt: skip
    p = plan.prediction
    assert p.bottleneck == "host memory"
    assert p.step_s == pytest.approx(p.detail["host_dram_bytes"] / 1e6)
    assert any(note.startswith("host memory:") and "host memory binds" in note
               for note in plan.notes)  # fmt: skip
    plan.save(tmp_path / "plan.json")
    saved = json.loads((tmp_path / "plan.json").read_text())["prediction"]["detail"]
    assert saved["host_dram_bytes"] == p.detail["host_dram_bytes"] > 0


def test_the_bf16_state_holds_weights_moments_and_a_gradient_in_ram():
    """bf16 weights (the bus copy), 8-bit moments, a bf16 gradient: no master, no
    remainder; compact holds a remainder more."""
    a = ModelAnalysis.of(_untied())
    n = a.n_params
    chunk = min(CHUNK, padded(max(u.n_owned for u in a.units)))
    # the update's chunk of temporaries: compact's fp32 operands; bf16's also hold the
    # stochastic rounding's int64 random bits and work (atom/optim/bf16.py)
    scratch = {"compact": SCRATCH_BUFFERS * 4 * chunk, "bf16": (6 * 4 + 2 * 8) * chunk}
    want = int(2 * n + n * (2 + 8 / BLOCK) + 2 * n)
    assert a.host_bytes(torch.bfloat16, "bf16") == want + scratch["bf16"]
    assert a.host_bytes(torch.bfloat16, "compact") == want + 2 * n + scratch["compact"]
    assert state_formats.update_dram_bytes("bf16", torch.bfloat16) == pytest.approx(
        state_formats.update_dram_bytes("compact", torch.bfloat16) - 4
    )


@pytest.mark.parametrize(
    "state,dtype,persistent,up,down",
    [
        # moments each way; the weights up but from the slot of a unit kept on the card,
        # and down but where they stay there
        ("bf16", torch.bfloat16, False, 4 * N + SCALES, 4 * N + SCALES),
        ("bf16", torch.bfloat16, True, 2 * N + SCALES, 2 * N + SCALES),
        ("bf16", torch.float16, False, 4 * N + SCALES, 6 * N + SCALES),
    ],
)
def test_the_bf16_states_bytes_over_the_bus(state, dtype, persistent, up, down):
    assert card_state_bytes(UNIT, state, dtype, persistent) == (up, down)


@pytest.mark.parametrize(
    "state,dtype,gone",
    [("compact", torch.bfloat16, 2), ("bf16", torch.bfloat16, 2), ("fp32", torch.bfloat16, 2)],
)
def test_a_unit_whose_weights_stay_on_the_card_has_none_on_the_host(
    monkeypatch, state, dtype, gone
):
    """compact: the bf16 master (the bus copy) is the card's; bf16: the weights; fp32: the
    bf16 bus copy (the fp32 master stays). Without the engine part, as before."""
    a, c, _ = _plan(state)
    kept = sum(a.units[i].n_owned for i in (2, 3))
    with_stay = host_bytes(a, c, dtype, True)
    monkeypatch.setattr(state_formats, "ENGINE_CARD_WEIGHTS_STAY", False)
    assert host_bytes(a, c, dtype, True) - with_stay == gone * kept


def test_the_bf16_state_is_chosen_only_when_asked_and_said_otherwise():
    plan, _, _ = run_profile(_untied(), target_batch=4, stated="rtx4090", progress=False)
    assert plan.swap["state"] in ("fp32", "compact") and plan.needs == []
    said = [n for n in plan.notes if n.startswith("the bf16 state (swap.state=bf16")]
    assert len(said) == 1 and "not bit-exact to fp32" in said[0] and "GiB of RAM" in said[0]
    asked = tiny_config(model={"tie_embeddings": False}, swap={"state": "bf16"})
    plan, _, _ = run_profile(asked, target_batch=4, stated="rtx4090", progress=False)
    assert plan.swap["state"] == "bf16" and plan.needs == []
    assert not [n for n in plan.notes if n.startswith("the bf16 state")]


def test_a_bf16_plan_without_the_engines_part_is_refused(monkeypatch):
    monkeypatch.setattr(state_formats, "ENGINE_BF16_STATE", False)
    asked = tiny_config(model={"tie_embeddings": False}, swap={"state": "bf16"})
    plan, _, _ = run_profile(asked, target_batch=4, stated="rtx4090", progress=False)
    assert plan.needs == ["the bf16 state (swap.state: bf16)"]
    assert "not built yet" in plan.notes[-1]
    with pytest.raises(ConfigError, match="does not run yet"):
        plan.apply(asked)


def test_both_ways_at_once_over_the_fake_cuda(monkeypatch):
    """Each direction timed on its own stream while the other runs, from one event; the
    copies ordered (no race the fake CUDA sees); bytes over the events' time (1 ms here)."""
    sim = install(monkeypatch)
    numel = 1024
    with sim.watch():
        up, down = bandwidth.measure_duplex(
            torch.device("cpu"), numel, torch.float32,
            alloc=lambda n: sim.device_tensor(torch.empty(n)),
        )  # fmt: skip
    assert sim.violations == []
    assert up == down == pytest.approx(numel * 4 / 1e-3)


def test_host_memory_bandwidth_counts_a_copys_reads_and_writes(monkeypatch):
    assert 1e8 < bandwidth.measure_host_memory(1 << 24, reps=2) < 1e13  # this machine's
    monkeypatch.setattr(bandwidth, "median_time", lambda fn, reps: 0.5)
    assert bandwidth.measure_host_memory(1 << 20) == 2 * (1 << 20) / 0.5


def test_the_presets_say_where_their_rates_come_from():
    for name in PRESETS:
        hw = stated(name)
        assert hw.host_mem_bps >= 50e9 and hw.duplex_down_bps < hw.d2h_bps
        assert "no desktop measurement published" in hw.rates_source
        assert "server" in hw.rates_source
    assert stated("rtx4090").host_mem_bps == 60e9
