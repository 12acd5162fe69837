"""ActivationDisk (atom/swap/activations.py): unit inputs kept on disk between a step's
forward and its backward come back bit for bit, in the backward's order, through a few RAM
slots; every byte is counted; an abandoned step frees every slot.

    pytest tests/test_activation_disk.py
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from atom.ground.errors import ConfigError
from atom.swap import activations
from atom.swap.activations import ActivationDisk
from atom.swap.pinned import page_aligned

SHAPE = (2, 16, 24)  # micro-batch x tokens x width: 1,536 bytes of bf16, a page on disk


def _step_keys(units: int, micros: int) -> list[tuple[int, int]]:
    return [(u, m) for u in range(1, units) for m in range(micros)]


def _inputs(keys, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(SHAPE, generator=g).to(dtype) for k in keys}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_of_unit_inputs_comes_back_bit_for_bit(tmp_path, dtype):
    """Forward: every (unit, micro-batch) input put; backward: got in reverse unit order,
    prefetched a few ahead, through 3 RAM slots for 15 inputs; three steps reuse the file."""
    keys = _step_keys(6, 3)
    disk = ActivationDisk(tmp_path, keys, SHAPE, dtype, n_slots=3)
    try:
        for step in range(3):
            want = _inputs(keys, dtype, seed=step)
            for k in keys:
                disk.put(k, want[k])
            backward = sorted(keys, key=lambda k: (-k[0], k[1]))
            for i, k in enumerate(backward):
                for ahead in backward[i : i + 2]:
                    disk.prefetch(ahead)
                got = disk.get(k)
                assert got.dtype == dtype and torch.equal(got, want[k]), (step, k)
        stride = page_aligned(torch.Size(SHAPE).numel() * dtype.itemsize)
        assert disk.bytes_written == disk.bytes_read == 3 * len(keys) * stride
    finally:
        disk.close()
    assert not disk.dir.exists()


def test_a_read_waits_for_its_write(tmp_path, monkeypatch):
    """A slow disk: the backward's read of an input still being written returns the new
    bytes, never the old ones from the step before."""
    keys = [(1, 0)]
    disk = ActivationDisk(tmp_path, keys, SHAPE, torch.float32, n_slots=2)
    real = os.pwrite

    def slow(fd, data, offset):
        time.sleep(0.3)
        return real(fd, data, offset)

    try:
        first, second = torch.zeros(SHAPE), torch.ones(SHAPE)
        disk.put((1, 0), first)
        assert torch.equal(disk.get((1, 0)), first)
        monkeypatch.setattr(activations.os, "pwrite", slow)
        disk.put((1, 0), second)
        assert torch.equal(disk.get((1, 0)), second)
    finally:
        disk.close()


def test_an_abandoned_step_frees_every_slot(tmp_path):
    """Inputs put and reads queued, then the step is abandoned: afterwards all slots are
    free and the next step runs through them as if nothing happened."""
    keys = _step_keys(4, 2)
    disk = ActivationDisk(tmp_path, keys, SHAPE, torch.float32, n_slots=2)
    try:
        want = _inputs(keys, torch.float32)
        for k in keys:
            disk.put(k, want[k])
        for k in keys[:2]:
            disk.prefetch(k)  # two reads holding both slots, never got
        disk.discard()
        assert disk._free.qsize() == 2 and not disk._reads
        done = threading.Event()

        def next_step():
            for k in keys:
                disk.put(k, want[k] * 2)
            for k in keys:
                assert torch.equal(disk.get(k), want[k] * 2)
            done.set()

        worker = threading.Thread(target=next_step, daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert done.is_set(), "the step after an abandoned one hung"
    finally:
        disk.close()


def test_bad_puts_and_directories_say_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        ActivationDisk(tmp_path / "missing", [(1, 0)], SHAPE, torch.float32)
    disk = ActivationDisk(tmp_path, [(1, 0)], SHAPE, torch.float32, n_slots=2)
    try:
        with pytest.raises(KeyError, match="no place"):
            disk.put((2, 0), torch.zeros(SHAPE))
        with pytest.raises(ValueError, match="expected"):
            disk.put((1, 0), torch.zeros(3))
    finally:
        disk.close()


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_on_cuda_streams_every_copy_is_ordered(tmp_path, monkeypatch, delay):
    """Over the fake torch.cuda (tests/fake_cuda.py): the writer waits for the copy into its
    slot before writing it (with copies that land late, an unordered write puts 0xFF bytes
    on disk: this test fails without that wait), the race detector finds nothing, and what
    comes back equals what went out. (The reader's wait before refilling a slot that a copy
    to the device still reads is invisible here: the refill is a syscall, not a torch op.)"""
    from tests.fake_cuda import install

    sim = install(monkeypatch)
    sim.copy_delay_s = delay
    keys = _step_keys(4, 2)
    disk = ActivationDisk(tmp_path, keys, SHAPE, torch.float32, n_slots=2, streams=True)
    try:
        want = _inputs(keys, torch.float32)
        with sim.watch():
            on_device = {k: sim.device_tensor(v.clone()) for k, v in want.items()}
            for k in keys:
                disk.put(k, on_device[k])
            got = {k: disk.get(k) for k in reversed(keys)}
            torch.cuda.synchronize()
        assert sim.violations == []
        for k in keys:
            assert torch.equal(got[k], want[k]), k
    finally:
        disk.close()


# ---------------------------------------------------------------- in the swap engine
N_LAYER, ACCUM = 3, 2  # block units 1-3; the embedding is unit 0, the head unit 4


def _engine_config(tmp_path, order: str, disk_acts: str, on_card: int = 0):
    from tests.conftest import tiny_config

    swap = {"checkpoint": True, "offload_activations": True, "acts_on_card": on_card,
            "order": order, "disk_acts": disk_acts}  # fmt: skip
    if disk_acts != "none":
        swap["disk_dir"] = str(tmp_path)
    return tiny_config(model={"n_layer": N_LAYER}, train={"grad_accum": ACCUM}, swap=swap)


def _engine_train(cfg, steps, backend=None, sim=None, abandon_at=None):
    """Losses, parameters and the ActivationDisk's byte counts after `steps` steps; with
    abandon_at=(step, visit), that step is first abandoned at that visit, then run again."""
    from contextlib import nullcontext

    from atom.optim import lr_at
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.test_swap_equivalence import batches_for

    engine = SwapEngine(cfg, backend or CpuBackend(), torch.float32)
    try:
        losses = []
        for s in range(steps):
            batches, lr = batches_for(s, cfg), lr_at(s, cfg.train)
            with sim.watch() if sim is not None else nullcontext():
                if abandon_at is not None and abandon_at[0] == s:
                    asked = iter(range(10**6))
                    stop = lambda asked=asked: next(asked) == abandon_at[1]  # noqa: E731
                    with pytest.raises(KeyboardInterrupt):
                        engine.train_step(batches, lr, stop=stop)
                    assert engine.acts._free.qsize() == len(engine.acts._bytes)  # all free
                losses.append(engine.train_step(batches, lr).loss)
        acts = engine.acts
        counts = (acts.bytes_written, acts.bytes_read, acts.stride) if acts else (0, 0, 0)
        return losses, engine.named_parameters(), counts, engine.disk_inputs
    finally:
        engine.close()


@pytest.mark.parametrize("order", ["unit", "micro"])
@pytest.mark.parametrize("disk_acts,on_card", [("all", 0), ("1", 1)])
def test_inputs_on_the_disk_train_bit_identically(tmp_path, order, disk_acts, on_card):
    """Offloaded inputs on the NVMe tier (all of them, or unit 1's with unit 3's on the
    card) train exactly as offloaded to RAM, and each step writes and reads each disk
    input once: |units| x micro-batches x its page-aligned place."""
    steps = 3
    want = _engine_train(_engine_config(tmp_path, order, "none", on_card), steps)
    got = _engine_train(_engine_config(tmp_path, order, disk_acts, on_card), steps)
    assert got[0] == want[0]
    for name, p in want[1].items():
        assert torch.equal(got[1][name], p), name
    written, read, stride = got[2]
    units = got[3]
    assert units == ({1, 2, 3} if disk_acts == "all" else {1})
    assert written == read == steps * len(units) * ACCUM * stride > 0
    assert list(tmp_path.glob("atom-tier-*")) == []  # closed: the file is gone


def test_an_abandoned_step_leaves_the_disk_inputs_ready_for_the_next(tmp_path):
    """Ctrl+C in the middle of step 1's backward (unit-major: visit 13 of 18), with disk
    inputs written and some read ahead: every RAM slot is free after it, and the run goes
    on exactly as one never interrupted."""
    want = _engine_train(_engine_config(tmp_path, "unit", "none"), 3)
    got = _engine_train(_engine_config(tmp_path, "unit", "all"), 3, abandon_at=(1, 13))
    assert got[0] == want[0]
    for name, p in want[1].items():
        assert torch.equal(got[1][name], p), name


def test_disk_inputs_on_the_cuda_backend_order_every_copy(tmp_path, monkeypatch):
    """The CUDA backend over the fake torch.cuda, copies landing late: the race detector
    finds nothing and training equals the same backend with every input on the device."""
    from tests.fake_cuda import cuda_backend

    base = _engine_config(tmp_path, "unit", "none")
    base.swap.offload_activations = False
    want = _engine_train(base, 2, *cuda_backend(monkeypatch, 1 << 16))
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    sim.copy_delay_s = 0.01
    got = _engine_train(_engine_config(tmp_path, "unit", "all"), 2, backend, sim)
    assert sim.violations == []
    assert got[0] == want[0]
    for name, p in want[1].items():
        assert torch.equal(got[1][name], p), name


def test_disk_acts_names_offloaded_units_only(tmp_path):
    from atom.config import ConfigError
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.conftest import tiny_config

    with pytest.raises(ConfigError, match="swap.disk_acts: unit 3's input is not offloaded"):
        SwapEngine(_engine_config(tmp_path, "unit", "1-3", on_card=1), CpuBackend(),
                   torch.float32)  # fmt: skip
    with pytest.raises(ConfigError, match="needs swap.offload_activations"):
        tiny_config(swap={"disk_acts": "all", "disk_dir": str(tmp_path)})
