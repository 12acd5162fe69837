"""The NVMe tier (swap.disk_dir): units' master weights and optimizer moments in files,
paged into RAM slots around their updates.

    pytest tests/test_disk_tier.py

Training with the tier is bit-identical to training with everything in RAM (fp32 and
compact state, every update mode and order), also when the disk is slow; checkpoints move
between tiers; a run killed mid-write resumes from its checkpoint exactly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from atom.config import ConfigError
from atom.optim import lr_at
from atom.run.train import Trainer
from atom.swap import disk_tier
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_swap_equivalence import batches_for

STEPS = 4


def run(cfg, steps: int = STEPS, engine: SwapEngine | None = None, start: int = 0):
    engine = engine or SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        losses = [
            engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
            for s in range(start, start + steps)
        ]
        return losses, engine.named_parameters(), engine
    finally:
        engine.close()


@pytest.mark.parametrize(
    "swap,train",
    [
        ({}, {}),  # exact: updates after the global norm, in forward order
        ({"update": "eager"}, {}),
        ({}, {"grad_clip": 0.0}),  # each unit updates as its gradient lands
        ({"order": "micro"}, {"grad_accum": 2}),
        ({"order": "unit", "layers_per_unit": 2}, {"grad_accum": 2}),
        ({"state": "compact"}, {}),
        ({"state": "compact", "update": "eager", "disk_slots": 2}, {}),
    ],
    ids=["exact", "eager", "noclip", "micro-accum", "unit-accum-2lpu", "compact", "compact-eager"],
)
def test_disk_tier_trains_bit_identically(tmp_path, swap, train):
    cfg = tiny_config(swap=swap, train=train)
    ram_losses, ram_params, _ = run(cfg)
    on_disk = tiny_config(swap={**swap, "disk_dir": str(tmp_path)}, train=train)
    disk_losses, disk_params, engine = run(on_disk)
    assert disk_losses == ram_losses
    for name, p in ram_params.items():
        assert torch.equal(disk_params[name], p), name
    # the cold state really lived on disk: every update read and wrote its unit
    n_units = len(engine.units)
    assert engine.tier.bytes_written >= STEPS * n_units * min(r.nbytes for r in engine.tier.records)
    assert not any(tmp_path.iterdir())  # the tier's directory is gone after close


def test_master_and_moments_are_not_in_ram(tmp_path):
    cfg = tiny_config(swap={"disk_dir": str(tmp_path)}, model={"tie_embeddings": False})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        engine.train_step(batches_for(0, cfg), 1e-3)
        engine.wait_idle()
        assert all(b.master.numel() == 0 for b in engine.store.buffers)  # paged out
        n = sum(b.spec.n_owned for b in engine.store.buffers)
        on_disk = sum(r.nbytes for r in engine.tier.records)
        assert on_disk >= 12 * n  # master + two moments, fp32
        # RAM: the bus copy and the gradient (fp32 on the CPU backend), 8 bytes a parameter
        assert engine.store.nbytes() == 8 * n
    finally:
        engine.close()


def test_slow_writes_never_let_a_unit_come_back_stale(tmp_path, monkeypatch):
    """Writes that take longer than a step: the next read of a unit must wait for its own
    write-back, or it would train on last step's weights."""
    real = os.pwrite

    def slow(fd, data, offset):
        time.sleep(0.01)
        return real(fd, data, offset)

    monkeypatch.setattr(disk_tier.os, "pwrite", slow)
    cfg = tiny_config(train={"grad_clip": 0.0})
    want, _, _ = run(cfg, steps=3)
    got, _, _ = run(tiny_config(train={"grad_clip": 0.0}, swap={"disk_dir": str(tmp_path)}), 3)
    assert got == want


@pytest.mark.parametrize("card", ["none", "all"], ids=["host", "card"])
@pytest.mark.parametrize("direction", ["ram-to-disk", "disk-to-ram"])
def test_checkpoints_move_between_tiers(tmp_path, direction, card):
    from atom.store.checkpoint import load_checkpoint, save_checkpoint

    ram = tiny_config(swap={"card_update": card})
    disk = tiny_config(swap={"card_update": card, "disk_dir": str(tmp_path / "tier")})
    (tmp_path / "tier").mkdir()
    first, second = (ram, disk) if direction == "ram-to-disk" else (disk, ram)
    a = SwapEngine(first, CpuBackend(), torch.float32)
    try:
        for s in range(3):
            a.train_step(batches_for(s, first), lr_at(s, first.train))
        path = save_checkpoint(tmp_path / "run", 3, a.state_files(), {"optimizer_steps": 3})
        tail = [a.train_step(batches_for(s, first), lr_at(s, first.train)).loss for s in (3, 4)]
    finally:
        a.close()
    b = SwapEngine(second, CpuBackend(), torch.float32, init=False)
    b.load_state(load_checkpoint(path).get, True, 3)
    resumed, _, _ = run(second, steps=2, engine=b, start=3)
    assert resumed == tail


def test_bad_disk_dir_is_one_clear_line(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="not a directory"):
        SwapEngine(tiny_config(swap={"disk_dir": str(missing)}), CpuBackend(), torch.float32)
    monkeypatch.setattr(disk_tier.shutil, "disk_usage", lambda p: type("U", (), {"free": 1024})())
    with pytest.raises(ConfigError, match="GiB free but the disk tier needs"):
        SwapEngine(tiny_config(swap={"disk_dir": str(tmp_path)}), CpuBackend(), torch.float32)


def test_a_dead_runs_tier_directory_is_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = tmp_path / f"{disk_tier.PREFIX}{child.pid}-abc"
    stale.mkdir()
    (stale / "unit_000.bin").write_bytes(b"\0" * 10)
    mine = tmp_path / f"{disk_tier.PREFIX}{os.getpid()}-def"  # a live process's: kept
    mine.mkdir()
    engine = SwapEngine(tiny_config(swap={"disk_dir": str(tmp_path)}), CpuBackend(), torch.float32)
    engine.close()
    assert not stale.exists() and mine.exists()


def test_disk_tier_refuses_peers_and_resident():
    with pytest.raises(ConfigError, match="peers"):
        tiny_config(swap={"disk_dir": "/tmp"}, gossip={"listen": "tcp://127.0.0.1:0"})
    with pytest.raises(ConfigError, match="--resident"):
        Trainer(tiny_config(swap={"disk_dir": "/tmp"}), "/tmp/unused-run", resident=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_during_tier_writes_then_resume_equals_uninterrupted(tmp_path, text_dataset):
    """SIGKILL a disk-tier run while it trains (every unit update is a tier write, so the
    kill lands among them), resume from its last checkpoint: the losses after the
    checkpoint are those of a run that was never killed."""
    tier = tmp_path / "tier"
    tier.mkdir()
    sets = [
        f"train.data={text_dataset}",
        "train.max_steps=40",
        "train.ckpt_interval=5",
        "train.eval_interval=0",
        "model.n_layer=2",
        "model.seq_len=32",
        f"swap.disk_dir={tier}",
    ]

    def argv(out, *extra):
        cmd = [sys.executable, "-m", "atom.cli", "train", "--out", str(out), "--no-progress"]
        for item in sets:
            cmd += ["--set", item]
        return cmd + list(extra)

    full = tmp_path / "full"
    subprocess.run(argv(full), check=True, capture_output=True, timeout=300)
    killed = tmp_path / "killed"
    child = subprocess.Popen(argv(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(killed.glob("checkpoints/step_*")):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.01)
        time.sleep(0.3)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert any(tier.iterdir())  # the killed run left its tier directory behind
    subprocess.run(
        argv(killed, "--resume", str(killed)), check=True, capture_output=True, timeout=300
    )

    def losses(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    got, want = losses(killed), losses(full)
    assert set(got) == set(want)
    assert got == want
    assert not any(tier.iterdir())  # the stale directory was removed, the resumed run's too


def test_atom_train_on_the_tier_through_the_cli(tmp_path, text_dataset, capsys):
    from atom.cli import main

    tier = tmp_path / "tier"
    tier.mkdir()
    sets = ["--set", f"train.data={text_dataset}", "--set", "model.n_layer=2",
            "--set", "swap.state=compact", "--set", f"swap.disk_dir={tier}"]  # fmt: skip

    def argv(out, *extra):
        return ["train", *sets, *extra, "--max-steps", "3", "--out", str(out), "--no-progress"]

    assert main(argv(tmp_path / "run")) == 0
    out = capsys.readouterr().out
    assert "compact state" in out and f"on disk in {tier}" in out
    missing = ["--set", f"swap.disk_dir={tmp_path / 'missing'}"]
    assert main(argv(tmp_path / "run2", *missing)) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and len(err.strip().splitlines()) == 1


def test_close_does_not_wait_for_reads_nobody_will_take(tmp_path):
    """More units asked for than slots and none taken (a step that failed half-way): the
    reader waits for a slot that never frees; close must not hang on it."""
    regions = [[disk_tier.Region(torch.float32, 1024, [(torch.empty(0), 0, (1024,))])]
               for _ in range(4)]  # fmt: skip
    tier = disk_tier.DiskTier(tmp_path, [disk_tier.UnitRecord(r) for r in regions], n_slots=2)
    for unit in range(4):
        tier.prefetch(unit)
    t0 = time.monotonic()
    tier.close()
    assert time.monotonic() - t0 < 5
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------- updates on the card


def _stepwise(cfg, threads: bool = False, steps: int = STEPS):
    """Train `steps` steps; with a tier, each step's (bytes read, bytes written) once its
    updates have all landed and their writes are on disk."""
    engine = SwapEngine(cfg, CpuBackend(helper_threads=threads), torch.float32)
    tier = engine.tier
    try:
        if tier:
            tier.flush()  # the initial weights' writes
        losses, io = [], []
        for s in range(steps):
            before = (tier.bytes_read, tier.bytes_written) if tier else None
            losses.append(engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss)
            engine.wait_idle()
            if tier:
                tier.flush()
                io.append((tier.bytes_read - before[0], tier.bytes_written - before[1]))
        return losses, engine.named_parameters(), io, engine
    finally:
        engine.close()


def _same_training(ram, disk) -> None:
    assert disk[0] == ram[0]
    for name, p in ram[1].items():
        assert torch.equal(disk[1][name], p), name


@pytest.mark.parametrize(
    "swap,train",
    [
        ({}, {}),
        ({"update": "eager"}, {}),
        ({}, {"grad_clip": 0.0}),
        ({"order": "unit"}, {"grad_accum": 3}),
        ({"order": "micro"}, {"grad_accum": 2}),
        ({"state": "compact"}, {}),
        ({"card_update": "1-2", "resident_units": 2}, {"grad_accum": 2}),
    ],
    ids=["exact", "eager", "noclip", "unit-accum3", "micro-accum2", "compact", "resident2"],
)
def test_card_update_on_the_tier_is_bit_identical(tmp_path, swap, train):
    """Units updated on the card page their master and moments in around the update, as
    host-updated units do: the same training as with the state in RAM, and each step reads
    and writes every unit's record once (a card unit's write goes out after its last piece
    has landed)."""
    swap = {"card_update": "all", **swap}
    model = {"arch": "llama", "n_kv_head": 2}
    ram = _stepwise(tiny_config(swap=swap, train=train, model=model))
    disk = _stepwise(
        tiny_config(swap={**swap, "disk_dir": str(tmp_path)}, train=train, model=model)
    )
    _same_training(ram, disk)
    engine = disk[3]
    assert engine.card_units and engine.card.updates == STEPS * len(engine.card_units)
    per_step = sum(r.nbytes for r in engine.tier.records)
    assert disk[2] == [(per_step, per_step)] * STEPS
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("threads", [False, True], ids=["inline", "threads"])
@pytest.mark.parametrize(
    "swap,train",
    [
        ({"card_update": "1-2", "disk_slots": 2}, {}),
        ({"card_update": "1-3", "update": "eager", "disk_slots": 2}, {}),
        ({"card_update": "2-4", "disk_slots": 2}, {"grad_clip": 0.0}),
        ({"card_update": "1-3", "order": "unit", "disk_slots": 2}, {"grad_accum": 3}),
    ],
    ids=["exact", "eager", "noclip", "unit-accum3"],
)
def test_card_and_host_units_share_two_slots(tmp_path, threads, swap, train):
    """GPT (tied embedding and head, so those update on the host) with block units on the
    card, and two RAM slots for everyone's records: reads are asked for in the order the
    updates take them, so nothing waits for a slot held by a later update. Compared on
    one backend: the inline and the threaded CPU backends differ bit-wise already. Three
    card units and two slots: a read held for a later update would leave none."""
    model = {"n_layer": 4}
    ram = _stepwise(tiny_config(swap=swap, train=train, model=model), threads)
    on_disk = {**swap, "disk_dir": str(tmp_path)}
    disk = _stepwise(tiny_config(swap=on_disk, train=train, model=model), threads)
    _same_training(ram, disk)
    per_step = sum(r.nbytes for r in disk[3].tier.records)
    assert disk[2] == [(per_step, per_step)] * STEPS


def _all_slots_free(tier) -> bool:
    tier.flush()
    return tier._free.qsize() == len(tier._mem) and not tier._slot_of and not tier._loaded


@pytest.mark.parametrize("how", ["non-finite", "error", "stop"])
def test_a_skipped_or_abandoned_card_update_gives_its_record_back(tmp_path, how):
    """The head (updated on the card) has its record read while it computes. An eager
    update skipped for a non-finite gradient, a step that fails in the head, and a Ctrl+C
    between the head's micro-batches: each gives the record back unwritten, and training
    goes on."""
    accum = 3 if how == "stop" else 1
    cfg = tiny_config(
        model={"arch": "llama", "n_kv_head": 2},
        train={"grad_accum": accum},
        swap={"card_update": "all", "update": "eager", "disk_dir": str(tmp_path)},
    )
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    tier = engine.tier
    try:
        engine.train_step(batches_for(0, cfg), 1e-3)
        before = {k: v.clone() for k, v in engine.named_parameters().items()}
        head = len(engine.units) - 1
        assert head in engine.card_units
        original = engine._head_step
        seen = []

        def broken(*args):
            loss, grad_h, grads = original(*args)
            if how == "error":
                raise RuntimeError("injected")
            grads[0] = torch.full_like(grads[0], float("nan"))
            return loss, grad_h, grads

        def stop() -> bool:  # asked before each visit: the head's second micro-batch
            seen.append(1)
            return len(seen) > len(engine.units) * accum - accum + 1

        written = tier.bytes_written
        if how == "stop":
            with pytest.raises(KeyboardInterrupt):
                engine.train_step(batches_for(1, cfg), 1e-3, stop=stop)
        else:
            engine._head_step = broken
            if how == "error":
                with pytest.raises(RuntimeError, match="injected"):
                    engine.train_step(batches_for(1, cfg), 1e-3)
            else:
                engine.train_step(batches_for(1, cfg), 1e-3)
                assert engine.skipped_units >= 1
        engine.wait_idle()
        assert _all_slots_free(tier)
        after = engine.named_parameters()
        owned = {p.full_name for p in engine.units[head].owned}
        assert all(torch.equal(before[n], after[n]) for n in owned)
        if how != "non-finite":  # abandoned before any update: nothing written
            assert tier.bytes_written == written
        engine._head_step = original
        assert math.isfinite(engine.train_step(batches_for(2, cfg), 1e-3).loss)
        engine.wait_idle()
        assert _all_slots_free(tier)
    finally:
        engine.close()


@pytest.mark.parametrize("register", ["arena", "refused"])
def test_tier_slots_are_page_locked_and_page_aligned_on_cuda(monkeypatch, tmp_path, register):
    """On the CUDA backend (faked on the CPU) the slots come from the backend's pinned
    arena, so a card update's state copies are DMA from the slot itself; where page-locking
    an arena is refused, from torch's pinned buffers, cut to a page boundary (O_DIRECT
    wants aligned buffers). Training there equals the CPU backend's."""
    from tests.fake_cuda import cuda_backend

    cfg = tiny_config(
        model={"arch": "llama", "n_kv_head": 2},
        swap={"card_update": "1-2", "disk_dir": str(tmp_path), "disk_slots": 2},
    )
    backend, sim = cuda_backend(monkeypatch, 1 << 15)
    sim.fail_host_register = register == "refused"
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        slots = engine.tier._tensors
        assert len(slots) == 2 and all(t.data_ptr() % disk_tier.ALIGN == 0 for t in slots)
        if register == "arena":
            locked = sim.registered.items()
            for t in slots:
                lo, hi = t.data_ptr(), t.data_ptr() + t.numel()
                assert any(p <= lo and hi <= p + n for p, n in locked)
        with sim.watch():
            losses = [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                      for s in range(2)]  # fmt: skip
        params = engine.named_parameters()
    finally:
        engine.close()
    assert sim.violations == []
    # the host work on helper threads, as on CUDA: the host updates' norms and sums then
    # run on a team of the host worker's size in both (inline, on the main thread's team,
    # the embedding's last bits depended on the thread count the tests before had left)
    want = _stepwise(cfg, threads=True, steps=2)
    assert losses == want[0]
    for name, p in want[1].items():
        assert torch.equal(params[name], p), name
