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
