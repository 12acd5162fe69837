"""The 70B plan's twin on this machine (issue 43, part 4): the llama twin (1.22M parameters,
untied) on a CPU with the "card" and RAM capped so `atom profile` picks the 70B plan's
shape: unit-major over 4 micro-batches, every update on the card, units kept there across
steps, the weights partly and the optimizer state wholly on the NVMe tier. It trains bit
for bit as the same model all in RAM, and resumes exactly after a SIGKILL mid-step. (The
plan's shape and its disk bytes against the engine's counters: tests/test_profile_tiers.py.)

    pytest tests/test_twin.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from atom.optim import lr_at
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.test_profile_tiers import TWIN, twin, twin_caps, twin_plan
from tests.test_swap_equivalence import batches_for

STEPS = 20


def _train(cfg, steps: int = STEPS):
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        losses = []
        for step in range(steps):
            batches = batches_for(step, cfg, vocab=TWIN["vocab_size"])
            losses.append(engine.train_step(batches, lr_at(step, cfg.train)).loss)
        return losses, engine.named_parameters()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return twin_plan(tmp_path_factory.mktemp("twin-plan"), *twin_caps(0.3))


@pytest.mark.slow
def test_the_twin_trains_bit_identically_to_all_in_ram_over_20_steps(plan, tmp_path):
    """The plan as atom profile wrote it (weights of units 0.. and every unit's state on the
    disk tiers, inputs on the card) against the same model with everything in RAM, its
    updates on the host: 20 losses and every parameter equal."""
    disk = tmp_path / "tier"
    disk.mkdir()
    tiered = plan.apply(twin(disk_dir=str(disk)))
    assert tiered.swap.disk_weights != "none" and tiered.swap.card_update == "all"
    in_ram = replace(
        tiered,
        swap=replace(tiered.swap, disk_dir=None, disk_weights="none", disk_acts="none",
                     card_update="none", resident_units=0, offload_activations=False),
    )  # fmt: skip
    got, want = _train(tiered), _train(in_ram)
    assert got[0] == want[0]
    for name, p in want[1].items():
        assert torch.equal(got[1][name], p), name
    assert list(disk.iterdir()) == []  # every tier's files removed at close


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_twin_resumes_exactly_after_sigkill_mid_step(plan, tmp_path, text_dataset):
    """`atom train --plan` with the twin's plan, killed (SIGKILL) while it trains past its
    first checkpoint (every step reads and writes both disk tiers, so the kill lands among
    their I/O), then resumed: its losses are those of a run never killed, and no tier
    directory is left behind."""
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    tier = tmp_path / "tier"
    tier.mkdir()
    sets = [f"model.{k}={v}" for k, v in TWIN.items()] + [
        f"train.data={text_dataset}", "train.max_steps=24", "train.ckpt_interval=8",
        "train.eval_interval=0", "train.dtype=fp32", "swap.state=fp32", f"swap.disk_dir={tier}",
    ]  # fmt: skip

    def argv(out, *extra):
        cmd = [sys.executable, "-m", "atom.cli", "train", "--plan", str(plan_path),
               "--out", str(out), "--no-progress"]  # fmt: skip
        for item in sets:
            cmd += ["--set", item]
        return cmd + list(extra)

    full = tmp_path / "full"
    done = subprocess.run(argv(full), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    killed = tmp_path / "killed"
    child = subprocess.Popen(argv(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(killed.glob("checkpoints/step_*")):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.01)
        time.sleep(0.5)  # into the steps after the checkpoint
    finally:
        child.kill()
        child.wait(timeout=30)
    assert any(tier.iterdir())  # the killed run left its tier directories behind
    resumed = subprocess.run(argv(killed, "--resume", str(killed)), capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def losses(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    got, want = losses(killed), losses(full)
    assert set(got) == set(want) and got == want
    assert not any(tier.iterdir())  # the stale directories removed, the resumed run's too
