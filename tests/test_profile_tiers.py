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
from atom.config import ConfigError
from atom.profiler import tiers
from atom.profiler.cost import Candidate, Prediction
from atom.profiler.hardware import GiB, stated
from atom.profiler.planner import PLAN_VERSION, Plan, Scored, choose
from atom.profiler.profile import run_profile
from tests.conftest import tiny_config

SMALL = {"arch": "llama", "n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 1024,
         "seq_len": 128}  # fmt: skip


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
    assert saved["version"] == PLAN_VERSION == 4 and saved["tiered"]
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
    # each kind of byte is said where it lives, and what the engine lacks, in one line
    assert sum(line.startswith("atom: tiered: ") for line in lines) == 4
    [needs] = [line for line in lines if line.startswith("atom: this plan needs")]
    assert "not built yet" in needs and "282.5 GiB of host RAM" in needs
    assert saved["needs"] and all(n in needs for n in saved["needs"])


def test_atom_train_refuses_the_tiered_plan_in_one_line(profile_70b):
    _, _, path = profile_70b
    code, out, err = run_cli(["train", "--config", "llama-3.1-70b", "--plan", str(path)])
    assert code == 2
    [line] = (out + err).strip().splitlines()
    assert line.startswith("atom: error: the plan needs what atom train does not run yet")


def test_an_older_plan_is_refused_in_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": PLAN_VERSION - 1, "swap": {}}))
    with pytest.raises(ConfigError, match="written by an older atom: run atom profile again$"):
        Plan.load(path)


def test_max_disk_writes_below_every_plan_is_one_line_and_exit_2(tmp_path):
    """A small Llama whose state only fits RAM with part of it on the NVMe disk: a write
    rate under every plan's is refused, naming the least any plan writes."""
    config = tmp_path / "small.yaml"
    config.write_text(json.dumps({"model": SMALL, "train": {"micro_batch": 1, "grad_accum": 8},
                                  "swap": {"state": "compact"}}))  # fmt: skip
    args = ["profile", "--config", str(config), "--hardware", "rtx4090", "--host-mem", "32MiB",
            "--out", str(tmp_path / "plan.json")]  # fmt: skip
    code, printed, _ = run_cli(args)
    assert code == 0 and "atom: disk: writes" in printed
    code, out, err = run_cli([*args, "--max-disk-writes", "1GB"])
    assert code == 2 and not out
    [line] = err.strip().splitlines()
    assert line.startswith("atom: error: no plan writes under --max-disk-writes 1.0 GB an hour")
    assert "the least any plan that fits writes is" in line


def test_the_nvme_rating_scales_the_endurance_a_day():
    cfg = small()
    plan, _, _ = run_profile(cfg, stated="rtx4090", host_mem=32 * 2**20, progress=False)
    rated, _, _ = run_profile(cfg, stated="rtx4090", host_mem=32 * 2**20, progress=False,
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


def test_ram_fills_with_weights_then_state_then_activations():
    """Weights first (a byte of them on disk is read twice a step), then the optimizer
    state, then the offloaded unit inputs; what does not fit goes to the disk, and the
    disk's reads and writes are those bytes once (weights read twice)."""
    from atom.profiler.planner import analysis

    cfg = small()
    a = analysis(cfg, 1)
    c = Candidate(1, 1, 1, 64, True, True, state="compact", card_update="all", tiered=True)
    hw = stated("rtx4090")
    roomy = tiers.split(a, c, torch.bfloat16, hw)
    assert roomy.on_disk == 0 and roomy.ram_acts == roomy.acts > 0
    hw.host_mem = 1  # the disk's staging ring, and nothing else in RAM
    staging = tiers.split(a, c, torch.bfloat16, hw).staging
    hw.host_mem = staging + roomy.weights + roomy.state // 2
    s = tiers.split(a, c, torch.bfloat16, hw)
    assert s.ram == hw.host_mem
    assert s.ram_weights == s.weights and s.ram_state == s.state // 2 and s.ram_acts == 0
    assert s.reads == 2 * s.disk_weights + s.disk_state + s.disk_acts
    assert s.writes == s.disk_state + s.disk_acts and s.disk_weights == 0


def test_a_slow_disk_binds_the_step(tmp_path):
    cfg = small()
    fast, _, _ = run_profile(cfg, stated="rtx4090", host_mem=32 * 2**20, progress=False)
    hw = stated("rtx4090", host_mem=32 * 2**20)
    spec = tmp_path / "slow-disk.json"
    spec.write_text(json.dumps({**hw.to_dict(), "disk_read_bps": 5e7, "disk_write_bps": 2.5e7}))
    slow, _, _ = run_profile(cfg, stated=str(spec), progress=False)
    assert slow.prediction.bottleneck == "disk"
    assert slow.prediction.step_s > 10 * fast.prediction.step_s
    assert slow.prediction.detail["disk_wait_s"] > 0


def test_no_tiered_plan_for_tied_weights_or_another_optimizer():
    gpt = tiny_config()
    with pytest.raises(Exception, match="no tiered plan: tied weights"):
        run_profile(gpt, stated="rtx4090", host_mem=GiB, progress=False, only_tiered=True)
    plan, _, _ = run_profile(small(), stated="rtx4090", host_mem=GiB, progress=False)
    assert not plan.tiered and not plan.needs and plan.disk["write_bytes_per_step"] == 0
