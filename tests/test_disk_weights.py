"""swap.disk_weights: the compute copy of card-updated units on the NVMe tier.

    pytest tests/test_disk_weights.py

Training with some units' weights on the tier is bit-identical to the same run with them
in RAM (on the same backend: the inline and threaded CPU backends differ bit-wise), each
step reads a streamed unit's record once per load and writes it once, a slow disk never
serves stale weights, checkpoints save and resume exactly, and units that cannot have
their weights on the tier are refused in one line.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from atom.config import ConfigError
from atom.optim import lr_at
from atom.swap import disk_tier
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from atom.swap.schedule import load_order
from atom.swap.weights import weight_slots
from tests.conftest import tiny_config
from tests.test_disk_tier import _same_training
from tests.test_swap_equivalence import batches_for

STEPS = 4
LLAMA = {"arch": "llama", "n_kv_head": 2}  # untied: units 0 (embedding) .. 4 (head)


def _config(tmp_path, swap: dict, train: dict, weights: str | None):
    swap = {"card_update": "all", "disk_dir": str(tmp_path), **swap}
    if weights is not None:
        swap["disk_weights"] = weights
    return tiny_config(swap=swap, train=train, model=LLAMA)


def _settled(engine) -> tuple[int, int]:
    """Once the updates have landed and their writes are on disk: the weight tier's
    (bytes read, bytes written) so far."""
    engine.wait_idle()
    if engine.wdisk is None:
        return 0, 0
    engine.wdisk.tier.flush()
    return engine.wdisk.tier.bytes_read, engine.wdisk.tier.bytes_written


def _stepwise(cfg, threads: bool, steps: int = STEPS, engine=None, start: int = 0, dtype=None):
    """Losses, parameters, each step's weight-tier (bytes read, bytes written), engine."""
    backend = CpuBackend(helper_threads=threads)
    engine = engine or SwapEngine(cfg, backend, dtype or torch.float32)
    try:
        marks, losses = [_settled(engine)], []  # the first: after the initial weights
        for s in range(start, start + steps):
            losses.append(engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss)
            marks.append(_settled(engine))
        io = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:], strict=False)]
        return losses, engine.named_parameters(), io, engine
    finally:
        engine.close()


def _loads_per_step(engine, n_micro: int) -> dict[int, int]:
    plan = engine._plan(n_micro)
    order = load_order(plan.visits, plan.windows, engine.resident_units)
    return {u: order.count(u) for u in engine.wdisk.units}


@pytest.mark.parametrize("threads", [False, True], ids=["inline", "threads"])
@pytest.mark.parametrize(
    "swap,train",
    [
        ({}, {}),
        ({"update": "eager"}, {}),
        ({}, {"grad_clip": 0.0}),
        ({"order": "unit"}, {"grad_accum": 2}),
        ({"order": "micro"}, {"grad_accum": 2}),
    ],
    ids=["exact", "eager", "noclip", "unit-accum2", "micro-accum2"],
)
def test_weights_on_the_tier_are_bit_identical(tmp_path, threads, swap, train):
    """Units 0-2 (embedding and two blocks) stream their weights from the tier: the same
    losses and parameters as with them in RAM, and per step a read per load and one write
    (unit-major: two reads, forward and backward; these units are never kept across the
    fwd/bwd turn)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ram = _stepwise(_config(tmp_path / "a", swap, train, None), threads)
    disk = _stepwise(_config(tmp_path / "b", swap, train, "0-2"), threads)
    _same_training(ram, disk)
    engine = disk[3]
    assert engine.wdisk.units == {0, 1, 2}
    # what the profiler's tiered split counts (profiler/tiers.py): prefetch + 3 slots
    assert len(engine.wdisk.tier._tensors) == weight_slots(engine.cfg.swap.prefetch) == 4
    records = engine.wdisk.tier.records
    loads = _loads_per_step(engine, train.get("grad_accum", 1))
    assert ram[2] == [(0, 0)] * STEPS
    if swap.get("order") != "micro":
        assert loads == {0: 2, 1: 2, 2: 2}
    reads = sum(loads[u] * records[u].nbytes for u in loads)
    writes = sum(r.nbytes for r in records.values())
    assert disk[2] == [(reads, writes)] * STEPS
    assert engine.store.nbytes() == ram[3].store.nbytes() - sum(
        engine.units[u].n_total * 4 for u in (0, 1, 2)
    )
    assert not any((tmp_path / "b").iterdir())


@pytest.mark.parametrize(
    "swap,train",
    [({}, {}), ({"update": "eager", "order": "micro"}, {"grad_accum": 2})],
    ids=["exact", "eager-micro-accum2"],
)
def test_compact_state_with_bf16_weights_on_the_tier(tmp_path, swap, train):
    """The 70B plan's shape: compact state, a bf16 compute copy on the tier."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    swap = {"state": "compact", "compile_update": False, **swap}
    ram = _stepwise(_config(tmp_path / "a", swap, train, None), False, dtype=torch.bfloat16)
    disk = _stepwise(_config(tmp_path / "b", swap, train, "all"), False, dtype=torch.bfloat16)
    _same_training(ram, disk)
    records = disk[3].wdisk.tier.records
    assert all(r.regions[0][0].dtype == torch.bfloat16 for r in records.values())
    assert all(w == sum(r.nbytes for r in records.values()) for _, w in disk[2])


def test_a_unit_kept_across_the_turn_is_read_once(tmp_path):
    """Unit 3, the last block, stays on the device from its forward to its backward
    (prefetch 1: two slots, it and the head): one read a step."""
    disk = _stepwise(_config(tmp_path, {}, {}, "3"), False)
    rec = disk[3].wdisk.tier.records[3].nbytes
    assert disk[2] == [(rec, rec)] * STEPS


def test_a_slow_weight_write_never_serves_stale_weights(tmp_path, monkeypatch):
    """Each write of the weights takes longer than a unit's compute: a load after an
    update must wait for its write (or share the update's slot), never read the record
    the disk still holds from the step before."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    swap = {"update": "eager", "prefetch": 2}
    ram = _stepwise(_config(tmp_path / "a", swap, {}, None), True)
    real = os.pwrite

    def slow(fd, data, offset):
        time.sleep(0.02)
        return real(fd, data, offset)

    monkeypatch.setattr(disk_tier.os, "pwrite", slow)
    disk = _stepwise(_config(tmp_path / "b", swap, {}, "all"), True)
    _same_training(ram, disk)


def test_checkpoints_save_and_resume_exactly(tmp_path):
    from atom.store.checkpoint import load_checkpoint, save_checkpoint

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = _config(tmp_path / "a", {"update": "eager"}, {}, "0-3")
    whole = _stepwise(cfg, False, steps=5)
    a = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        for s in range(3):
            a.train_step(batches_for(s, cfg), lr_at(s, cfg.train))
        path = save_checkpoint(tmp_path / "run", 3, a.state_files(), {"optimizer_steps": 3})
        run_state = a.run_state()
    finally:
        a.close()
    cfg_b = _config(tmp_path / "b", {"update": "eager"}, {}, "0-3")
    b = SwapEngine(cfg_b, CpuBackend(), torch.float32, init=False)
    b.load_state(load_checkpoint(path).get, True, 3)
    b.load_run_state(run_state)
    resumed = _stepwise(cfg_b, False, steps=2, engine=b, start=3)
    assert resumed[0] == whole[0][3:]
    for name, p in whole[1].items():
        assert torch.equal(resumed[1][name], p), name


@pytest.mark.parametrize(
    "swap,model,match",
    [
        ({"card_update": "1-3", "disk_weights": "0"}, LLAMA, "unit 0 is updated on the host"),
        ({"card_update": "all", "resident_units": 1, "disk_weights": "3"}, LLAMA,
         "unit 3 is resident"),
        ({"card_update": "1-3", "disk_weights": "0"}, {}, "unit 0 shares tied weights"),
        ({"card_update": "all", "disk_weights": "9"}, LLAMA, "unit 9 does not exist"),
    ],
    ids=["host-updated", "resident", "tied", "out-of-range"],
)  # fmt: skip
def test_units_that_cannot_have_their_weights_on_the_tier_are_refused(tmp_path, swap, model, match):
    cfg = tiny_config(swap={"disk_dir": str(tmp_path), **swap}, model=model)
    with pytest.raises(ConfigError, match=match) as err:
        SwapEngine(cfg, CpuBackend(), torch.float32)
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())


def test_disk_weights_needs_a_disk_dir():
    with pytest.raises((ConfigError, ValueError), match="needs swap.disk_dir"):
        tiny_config(swap={"card_update": "all", "disk_weights": "0"})


def test_an_abandoned_step_gives_every_weight_record_back(tmp_path):
    """Ctrl+C in the backward (loads in flight, records read ahead), then training goes on:
    every slot of the weights tier is free, nothing was written, and the next steps equal
    those of a run never interrupted."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    swap = {"prefetch": 2}  # exact: nothing commits the step before its end
    whole = _stepwise(_config(tmp_path / "a", swap, {}, None), False, steps=3)
    cfg = _config(tmp_path / "b", swap, {}, "0-3")
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    wtier = engine.wdisk.tier
    try:
        engine.train_step(batches_for(0, cfg), lr_at(0, cfg.train))
        engine.wait_idle()
        wtier.flush()
        written, asked = wtier.bytes_written, []

        def stop() -> bool:  # the head's visit is the 5th: stop at the 7th, mid-backward
            asked.append(1)
            return len(asked) == 7

        with pytest.raises(KeyboardInterrupt):
            engine.train_step(batches_for(1, cfg), lr_at(1, cfg.train), stop=stop)
        engine.wait_idle()
        wtier.flush()
        assert wtier._free.qsize() == len(wtier._mem) and not wtier._loaded
        assert not wtier._holds and wtier.bytes_written == written
    except BaseException:
        engine.close()
        raise
    rest = _stepwise(cfg, False, steps=2, engine=engine, start=1)  # closes it
    assert rest[0] == whole[0][1:]
    for name, p in whole[1].items():
        assert torch.equal(rest[1][name], p), name


@pytest.mark.parametrize("delay", [0.0, 0.02], ids=["prompt", "late-copies"])
def test_the_cuda_backend_orders_every_weight_copy(monkeypatch, tmp_path, delay):
    """On the CUDA backend (faked on the CPU): a load's copy reads the tier's pinned slot
    before the slot goes to another unit, and the update's new weights land in the slot
    before its write; training equals the CPU backend's."""
    from tests.fake_cuda import cuda_backend

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    swap = {"update": "eager", "compile_update": False}
    want = _stepwise(_config(tmp_path / "a", swap, {"grad_accum": 2}, "0-2"), False, steps=2)
    cfg = _config(tmp_path / "b", swap, {"grad_accum": 2}, "0-2")
    backend, sim = cuda_backend(monkeypatch, 1 << 15)
    sim.copy_delay_s = delay
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        losses = []
        for s in range(2):
            with sim.watch():
                losses.append(engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss)
        params = engine.named_parameters()
    finally:
        engine.close()
    assert sim.violations == []
    assert losses == want[0]
    for name, p in want[1].items():
        assert torch.equal(params[name], p), name


def _records(n: int) -> dict:
    out = {}
    for u in range(n):
        t = torch.empty(0)
        out[u] = (
            disk_tier.UnitRecord([disk_tier.Region(torch.float32, 1024, [(t, 0, (1024,))])]),
            t,
        )
    return out


def test_a_second_acquire_shares_the_slot_and_the_last_release_writes(tmp_path):
    """The tier counts holders: a load of a unit its update still holds reads the slot the
    update writes, and the write goes out once, when the last holder is done."""
    recs = _records(2)
    tier = disk_tier.DiskTier(tmp_path, {u + 5: r for u, (r, _) in recs.items()}, n_slots=2)
    try:
        t5 = recs[0][1]
        tier.acquire(5, fresh=True)  # the update: written whole
        t5.fill_(3.0)
        tier.acquire(5)  # the next load, while the update holds it
        assert t5.numel() == 1024 and float(t5[0]) == 3.0
        tier.release(5, dirty=False)  # the load: still held by the update
        assert t5.numel() == 1024
        tier.release(5, dirty=True)
        tier.flush()
        assert t5.numel() == 0 and tier.bytes_written == 4096 and tier.bytes_read == 0
        tier.acquire(5)
        assert float(t5[1023]) == 3.0 and tier.bytes_read == 4096
        tier.release(5, dirty=False)
    finally:
        tier.close()


def test_a_slot_is_not_reused_while_a_copy_still_reads_it(tmp_path):
    """release(after=...): the slot goes to another unit only once `after` returned (the
    load's copy to the device has read it)."""
    import threading

    recs = _records(3)
    tier = disk_tier.DiskTier(tmp_path, {u: r for u, (r, _) in recs.items()}, n_slots=2)
    copied, got = threading.Event(), threading.Event()
    try:
        tier.acquire(0)
        tier.release(0, dirty=False, after=copied.wait)
        tier.acquire(1)
        threading.Thread(target=lambda: (tier.acquire(2), got.set()), daemon=True).start()
        assert not got.wait(0.3)  # both slots taken: 1 held, 0 still being read
        copied.set()
        assert got.wait(5)
        tier.release(1, dirty=False)
        tier.release(2, dirty=False)
    finally:
        copied.set()
        tier.close()
