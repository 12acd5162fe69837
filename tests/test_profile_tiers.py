"""The tiered plan (profiler/tiers.py) and the disk's life (issue 43): a 70B plan on a 4090
with 128 GiB of RAM, the bytes it writes and the drive endurance it uses, --max-disk-writes,
the planner's preference for fewer writes, and plan.json's new fields.

pytest tests/test_profile_tiers.py
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from atom.cli import main
from atom.config import ConfigError, load_config, replace
from atom.profiler import tiers
from atom.profiler.cost import Candidate, Prediction
from atom.profiler.hardware import GiB, stated
from atom.profiler.planner import PLAN_VERSION, Plan, Scored, choose
from atom.profiler.profile import run_profile
from tests.conftest import tiny_config
from tools.bench.twin import CPU, TWIN, caps

SMALL = {"arch": "llama", "n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 1024,
         "seq_len": 128}  # fmt: skip


# the plan's llama twin (issue 43): TWIN, the 70B's shape at 1.22M parameters, from the bench
TWIN_TRAIN = {"micro_batch": 2, "grad_accum": 4}


def twin(**swap):
    return tiny_config(model=TWIN, train=TWIN_TRAIN, swap={"state": "fp32", **swap})


def small(**swap):
    return tiny_config(model=SMALL, train={"micro_batch": 1, "grad_accum": 8},
                       swap={"state": "compact", **swap})  # fmt: skip


def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def profile_70b(tmp_path_factory):
    """The issue's command, once: `atom profile --config llama-3.1-70b --hardware rtx4090
    --host-mem 128GiB --batch 64`."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    args = ["--hardware", "rtx4090", "--host-mem", "128GiB", "--batch", "64", "--out", str(path)]
    code, printed, _ = run_cli(["profile", "--config", "llama-3.1-70b", *args])
    return code, printed, path


def test_a_70b_plan_on_a_4090_with_128_gib_states_what_it_costs_the_disk(profile_70b):
    code, printed, path = profile_70b
    assert code == 0
    saved = json.loads(path.read_text())
    assert saved["version"] == PLAN_VERSION == 6 and saved["tiered"] and saved["disk_tier"]
    p = saved["prediction"]
    assert p["tokens_per_s"] >= 150 and p["peak_device_bytes"] <= 24 * GiB
    assert p["host_bytes"] <= 128 * GiB
    disk = saved["disk"]
    assert disk["write_bytes_per_step"] > 100e9 and disk["read_bytes_per_step"] > 0
    assert disk["write_bytes_per_hour"] == pytest.approx(
        disk["write_bytes_per_step"] * 3600 / p["step_s"]
    )
    assert disk["nvme_tbw"] == tiers.DEFAULT_TBW
    assert disk["endurance_per_day"] == pytest.approx(24 * disk["write_bytes_per_hour"] / 600e12)
    lines = printed.splitlines()
    [life] = [line for line in lines if line.startswith("atom: disk: writes")]
    assert "GB a step" in life and "an hour" in life and "600 TBW" in life
    assert f"{disk['endurance_per_day']:.1%}" in life
    # each kind of byte is said where it lives, the units on the disk named; the engine
    # lacks nothing of it
    tiered = [line for line in lines if line.startswith("atom: tiered: ")]
    assert len(tiered) == 4 and "on the NVMe disk (units 0-" in tiered[1]
    assert not saved["needs"] and not any(
        line.startswith("atom: this plan needs") for line in lines
    )
    assert lines[-1].startswith("atom: wrote ") and "train with: atom train --plan" in lines[-1]


def test_atom_train_applies_the_tiered_plan_with_a_disk_directory(profile_70b, tmp_path):
    """The 70B plan is one atom train runs: without a disk directory it says so in one line;
    with one, the plan's swap section puts the units on the disk it names."""
    _, _, path = profile_70b
    code, out, err = run_cli(["train", "--config", "llama-3.1-70b", "--plan", str(path)])
    assert code == 2
    [line] = (out + err).strip().splitlines()
    assert line.startswith("atom: error: the plan keeps") and "swap.disk_dir=DIR" in line
    plan = Plan.load(path)
    cfg = plan.apply(replace(load_config("llama-3.1-70b"), swap={"disk_dir": str(tmp_path)}))
    s = plan.prediction.detail["tiers"]
    assert cfg.swap.disk_dir == str(tmp_path) and cfg.swap.card_update == "all"
    assert (cfg.swap.disk_weights, cfg.swap.disk_acts) == (s["weight_units"], s["input_units"])
    assert cfg.swap.disk_weights != "none" and cfg.train.grad_accum == plan.grad_accum


def test_an_older_plan_is_refused_in_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": PLAN_VERSION - 1, "swap": {}}))
    with pytest.raises(ConfigError, match="written by an older atom: run atom profile again$"):
        Plan.load(path)


def test_max_disk_writes_below_every_plan_is_one_line_and_exit_2(tmp_path):
    """The llama twin, whose state only fits RAM with part of it on the NVMe disk: a write
    rate under every plan's is refused, naming the least any plan writes."""
    config = tmp_path / "small.yaml"
    config.write_text(json.dumps({"model": TWIN, "train": TWIN_TRAIN}))
    # (8 MiB: in 10 compact state fits RAM, the weights kept on the card not on the host)
    args = ["profile", "--config", str(config), "--hardware", "rtx4090", "--host-mem", "8MiB",
            "--out", str(tmp_path / "plan.json")]  # fmt: skip
    code, printed, _ = run_cli(args)
    assert code == 0 and "atom: disk: writes" in printed
    code, out, err = run_cli([*args, "--max-disk-writes", "1GB"])
    assert code == 2 and not out
    [line] = err.strip().splitlines()
    assert line.startswith("atom: error: no plan writes under --max-disk-writes 1.0 GB an hour")
    assert "the least any plan that fits writes is" in line


def test_the_nvme_rating_scales_the_endurance_a_day():
    cfg = twin()
    plan, _, _ = run_profile(cfg, stated="rtx4090", host_mem=10 * 2**20, progress=False)
    rated, _, _ = run_profile(cfg, stated="rtx4090", host_mem=10 * 2**20, progress=False,
                              nvme_tbw=1200)  # fmt: skip
    assert plan.disk["write_bytes_per_step"] > 0
    assert rated.disk["endurance_per_day"] == pytest.approx(plan.disk["endurance_per_day"] / 2)
    assert any("1,200 TBW" in note for note in rated.notes)


def scored(step: float, writes: float) -> Scored:
    c = Candidate(1, 1, 1, 1, True, False, state="compact")
    p = Prediction(step, 1 / step, 0, 0, "compute", {"disk_write_bytes": writes})
    return Scored(c, p, True, True)


def test_the_plan_writing_less_wins_when_steps_tie():
    cfg, hw = small(), stated("rtx4090")
    fast, lean, slow = scored(100.0, 10e9), scored(102.0, 5e9), scored(110.0, 0.0)
    ranked = choose([fast, lean, slow], hw, cfg, None)
    assert ranked == [lean, fast, slow]  # within 3%: fewer writes; beyond it: faster
    ram = [scored(100.0, 0.0), scored(102.0, 0.0)]  # equal writes: the faster, as before
    assert choose(ram[::-1], hw, cfg, None)[0].prediction.step_s == 100.0


def test_ram_takes_whole_units_weights_then_state_then_inputs():
    """RAM takes whole units: the weights from the head's side (the disk's are units 0, 1,
    ...), then the state (all of it or none: swap.disk_dir pages every unit's), then the
    offloaded inputs from the head's side; each kind on the disk brings its RAM slots, and
    the disk's bytes are the engine's 4 KiB-aligned records (the compact record holds the
    bf16 master too)."""
    from atom.profiler.planner import analysis
    from atom.swap.pinned import page_aligned

    cfg = small()
    a = analysis(cfg, 1)
    c = Candidate(1, 1, 1, 64, True, True, state="compact", card_update="all", tiered=True)
    hw = stated("rtx4090")
    roomy = tiers.split(a, c, torch.bfloat16, hw)
    assert roomy.on_disk == 0 and roomy.ram_acts == roomy.acts > 0
    assert roomy.ram == roomy.staging + roomy.weights + roomy.state + roomy.acts
    records = a.record_bytes("compact")
    w = [u.n_total * 2 for u in a.units]
    hw.host_mem = roomy.ram - 1  # the state goes to the disk, and the acts fit again
    s = tiers.split(a, c, torch.bfloat16, hw)
    assert (s.state_units, s.weight_units, s.input_units) == ("all", "none", "none")
    assert s.disk_state == s.state == sum(records) and s.ram_weights == s.weights
    assert s.reads == s.writes == sum(records) and s.ram <= hw.host_mem
    # a byte short of every unit's weights: the inputs (after the weights) all go to the
    # disk, and their slots and units 0.. (as many as pay for the slots of weights loaded
    # from it) make room; those weights are read twice, written once
    one = page_aligned(a.hidden_bytes(1, torch.bfloat16))
    hw.host_mem = s.staging + sum(w) - 1
    t = tiers.split(a, c, torch.bfloat16, hw)
    first, _, last = t.weight_units.partition("-")
    k = int(last or first) + 1
    assert first == "0" and 0 < k < len(a.units), t.weight_units  # the head stays
    assert t.ram_weights == sum(w[k:]) and t.ram <= hw.host_mem
    n_in = len(a.units) - 2
    assert t.input_units == f"1-{n_in}" and t.ram_acts == 0 and t.disk_acts == 64 * one * n_in
    aligned = sum(page_aligned(x) for x in w[:k])
    assert t.disk_weights == aligned and t.forward_reads == aligned
    assert t.writes == aligned + sum(records) + t.disk_acts
    # prefetch 1: the forward's last unit stays on the card for the backward, read once
    turn = len(a.units) - 2
    again = aligned - (page_aligned(w[turn]) if k > turn else 0)
    assert t.reads == aligned + again + sum(records) + t.disk_acts


def test_a_slow_disk_binds_the_step(tmp_path):
    cfg = twin()
    fast, _, _ = run_profile(cfg, stated="rtx4090", host_mem=10 * 2**20, progress=False)
    hw = stated("rtx4090", host_mem=10 * 2**20)
    spec = tmp_path / "slow-disk.json"
    spec.write_text(json.dumps({**hw.to_dict(), "disk_read_bps": 5e7, "disk_write_bps": 2.5e7}))
    slow, _, _ = run_profile(cfg, stated=str(spec), progress=False)
    assert slow.prediction.bottleneck == "disk"
    assert slow.prediction.step_s > 10 * fast.prediction.step_s
    if slow.prediction.detail.get("tiers"):  # the tiered plan says how long it waits
        assert slow.prediction.detail["disk_wait_s"] > 0


def test_no_tiered_plan_for_tied_weights_or_another_optimizer():
    gpt = tiny_config()
    with pytest.raises(Exception, match="no tiered plan: tied weights"):
        run_profile(gpt, stated="rtx4090", host_mem=GiB, progress=False, only_tiered=True)
    plan, _, _ = run_profile(small(), stated="rtx4090", host_mem=GiB, progress=False)
    assert not plan.tiered and not plan.needs and plan.disk["write_bytes_per_step"] == 0


def twin_caps(weights_in_ram: float) -> tuple[int, int]:
    """(gpu_mem, host_mem) that put the twin in the 70B plan's shape (tools/bench/twin.py)."""
    return caps(weights_in_ram)


def twin_plan(tmp_path, gpu: int, host: int):
    spec = tmp_path / "cpu.json"
    spec.write_text(json.dumps(CPU))
    plan, _, _ = run_profile(twin(), stated=str(spec), gpu_mem=gpu, host_mem=host,
                             progress=False, only_tiered=True)  # fmt: skip
    return plan


def test_the_twin_plan_has_the_70b_shape(tmp_path):
    """The llama twin on a CPU with the card and RAM capped (issue 43): unit-major over
    several micro-batches, every update on the card, units kept there across steps, the
    weights partly on the NVMe tier (units 0..), the state all on it; and the engine trains
    it, reading and writing what the plan says."""
    gpu, host = twin_caps(0.3)
    plan = twin_plan(tmp_path, gpu, host)
    s = plan.prediction.detail["tiers"]
    assert plan.tiered and plan.disk_tier and plan.grad_accum > 1
    assert plan.swap["order"] == "unit" and plan.swap["card_update"] == "all"
    assert plan.swap["resident_units"] >= 1
    assert s["weight_units"].startswith("0-") and 0 < s["ram_weights"] < s["weights"]
    assert s["state_units"] == "all" and s["disk_state"] == s["state"] > 0
    assert plan.prediction.peak_device_bytes <= gpu and plan.prediction.host_bytes <= host
    assert plan.disk["write_bytes_per_step"] == s["disk_weights"] + s["disk_state"] + s["disk_acts"]
    assert plan.needs == [] and plan.swap["disk_weights"] == s["weight_units"]
    # the engine runs it: the three tiers' bytes a step, and the RAM it holds, are the plan's
    read, written, ram = run_twin(plan, tmp_path)
    assert (read, written) == (plan.disk["read_bytes_per_step"], plan.disk["write_bytes_per_step"])
    assert ram + s["ram_acts"] == plan.prediction.host_bytes


def run_twin(plan, tmp_path, steps: int = 3) -> tuple[int, int, int]:
    """The plan applied and trained on the CPU backend: the bytes the NVMe tiers (state,
    weights) and the activation disk read and wrote in the last step, and the RAM the
    engine holds (host store and every tier's slots)."""
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.test_swap_equivalence import batches_for

    disk = tmp_path / "tier"
    disk.mkdir()
    cfg = plan.apply(twin(disk_dir=str(disk)))
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        counts = []
        for step in range(steps):
            engine.train_step(batches_for(step, cfg, vocab=TWIN["vocab_size"]), 1e-3)
            engine.wait_idle()
            tiers_ = [engine.tier] + [t.tier for t in [engine.wdisk] if t]
            for tier in tiers_:  # the writes behind the step's last updates
                tier.flush()
            tiers_ += [engine.acts] if engine.acts else []
            counts.append((sum(t.bytes_read for t in tiers_), sum(t.bytes_written for t in tiers_)))
        ram = engine.store.nbytes() + sum(t.slot_bytes for t in tiers_)
    finally:
        engine.close()
    (r1, w1), (r2, w2) = counts[-2:]
    return r2 - r1, w2 - w1, ram


def test_the_twins_disk_bytes_are_what_the_engine_counts(tmp_path):
    """With every weight in RAM and the state on the NVMe tier, the twin's plan is one the
    engine runs (it needs nothing more, and applies): a step reads and writes on the tier
    the bytes the plan says, and the RAM the engine holds (host store and tier slots) is
    the plan's host figure."""
    plan = twin_plan(tmp_path, *twin_caps(1.0))
    s = plan.prediction.detail["tiers"]
    assert plan.disk_tier and s["weight_units"] == "none" and s["state_units"] == "all"
    assert s["input_units"] == "none" and plan.needs == []
    assert plan.swap["card_update"] == "all" and plan.swap["resident_units"] >= 1
    read, written, ram = run_twin(plan, tmp_path)
    assert (read, written) == (plan.disk["read_bytes_per_step"], plan.disk["write_bytes_per_step"])
    assert ram + s["ram_acts"] == plan.prediction.host_bytes


def test_the_twins_unit_inputs_on_the_disk_are_what_the_engine_counts(tmp_path):
    """A card with no room for unit inputs and RAM for two units' of them, beside every
    weight and the tiers' slots: the others go to the disk (units 1.., swap.disk_acts), and
    a step's reads and writes there and the RAM held are the plan's, to the byte."""
    from atom.profiler.cost import peak_device_bytes
    from atom.profiler.planner import analysis
    from atom.swap.pinned import page_aligned

    a = analysis(twin(), 1)
    one = a.hidden_bytes(4, torch.float32) * 2  # a unit's inputs at 4 x 2
    shape = Candidate(1, 0, 4, 2, True, True, card_update="all", update="eager", tiered=True)
    gpu = peak_device_bytes(a, shape, torch.float32, cuda=False)
    host = (tiers.STATE_SLOTS * max(a.record_bytes("fp32")) + sum(u.n_total * 4 for u in a.units)
            + tiers.INPUT_SLOTS * page_aligned(one // 2) + 2 * one)  # fmt: skip
    plan = twin_plan(tmp_path, gpu, host)
    s = plan.prediction.detail["tiers"]
    assert s["weight_units"] == "none" and s["input_units"].startswith("1-") and s["ram_acts"]
    assert plan.swap["disk_acts"] == s["input_units"] and plan.needs == []
    read, written, ram = run_twin(plan, tmp_path)
    assert (read, written) == (plan.disk["read_bytes_per_step"], plan.disk["write_bytes_per_step"])
    assert ram + s["ram_acts"] == plan.prediction.host_bytes
