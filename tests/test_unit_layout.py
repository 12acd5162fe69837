"""A unit's flat layout: every parameter 16-byte aligned, padding that stays zero.

    pytest tests/test_unit_layout.py

Compiled blocks get each parameter as a view of a device slot; Inductor's kernels read
16-byte aligned inputs 16 bytes at a time. A width that is not a multiple of 8 used to put
parameters at 2-byte offsets; now each starts at a multiple of 8 elements and the padding
between them is zeros in every buffer of the layout (master, gradient, moments, what
crosses the bus). A model of such a width trains swapped as resident, on the CPU backend
and on the CUDA backend over the fake torch.cuda (whose gradient pieces land at the
padded offsets), through gradient accumulation and a checkpoint round trip.
"""

from __future__ import annotations

import pytest
import torch

from atom.model import build_model
from atom.optim import lr_at
from atom.resident.engine import ResidentEngine
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from atom.swap.units import ALIGN, partition
from tests.conftest import tiny_config
from tests.fake_cuda import cuda_backend
from tests.test_swap_equivalence import batches_for, rel_err

# d_model 36 (not a multiple of 8), vocabulary 251: almost no tensor fills whole 16 bytes
ODD = {"d_model": 36, "n_head": 3, "n_kv_head": 1, "vocab_size": 251, "n_layer": 2}


def _units(arch: str, tie: bool):
    cfg = tiny_config(model={**ODD, "arch": arch, "tie_embeddings": tie})
    return partition(build_model(cfg.model, device="meta"), 1)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_every_parameter_view_of_an_odd_width_unit_is_16_byte_aligned(arch, tie):
    units = _units(arch, tie)
    assert any(sum(p.numel for p in u.params) < u.n_total for u in units)  # padded
    for unit in units:
        flat = torch.empty(unit.n_total, dtype=torch.bfloat16)  # the narrowest a slot is
        views = unit.views(flat)
        assert len(views) == len(unit.params)
        for view in views.values():
            assert (view.data_ptr() - flat.data_ptr()) % 16 == 0
        spans = sorted((p.offset, p.offset + p.numel) for p in unit.params)
        assert all(end <= start for (_, end), (start, _) in zip(spans[:-1], spans[1:], strict=True))
        assert spans[-1][1] <= unit.n_total
        owned_end = max((p.offset + p.numel for p in unit.owned), default=0)
        assert owned_end <= unit.n_owned and all(p.offset >= unit.n_owned for p in unit.aliases)
        decayed = [p for p in unit.owned if p.decay]
        assert all(p.offset + p.numel <= unit.n_decay for p in decayed)
        assert all(p.offset >= unit.n_decay for p in unit.owned if not p.decay)
        assert unit.n_decay % ALIGN == unit.n_owned % ALIGN == unit.n_total % ALIGN == 0


def _padding(unit) -> torch.Tensor:
    """True where a unit's owned region holds no parameter."""
    mask = torch.ones(unit.n_owned, dtype=torch.bool)
    for p in unit.owned:
        mask[p.offset : p.offset + p.numel] = False
    return mask


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty fills floating memory with NaN: padding that anything reads before it
    is written shows up (real uninitialised memory is usually whatever was there)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


CASES = {
    "gpt tied, cpu, per-parameter gradients": ("gpt", "cpu", {"grad_accum": 1}),
    "llama, cpu, summed on the device": ("llama", "cpu", {"grad_accum": 2}),
    "gpt tied, fake cuda, per-parameter gradients": ("gpt", "cuda", {"grad_accum": 1}),
    "llama, fake cuda, summed on the device": ("llama", "cuda", {"grad_accum": 2}),
}


@pytest.mark.parametrize("arch,backend,train", CASES.values(), ids=CASES.keys())
def test_an_odd_width_model_trains_swapped_as_resident(
    monkeypatch, poisoned_empty, arch, backend, train
):
    """Steps, a checkpoint of weights and moments loaded into a fresh engine, a step
    more: equal to plain PyTorch, and the padding of every unit's master still zeros."""
    cfg = tiny_config(
        model={**ODD, "arch": arch, "tie_embeddings": arch == "gpt"},
        train={**train, "grad_clip": 1.0},
        swap={"layers_per_unit": 1, "prefetch": 1, "order": "unit"},
    )

    def make():
        if backend == "cpu":
            return SwapEngine(cfg, CpuBackend(), torch.float32), None
        device, sim = cuda_backend(monkeypatch, 0)
        return SwapEngine(cfg, device, torch.float32), sim

    def step(engine, sim, s):
        batches, lr = batches_for(s, cfg, vocab=cfg.model.vocab_size), lr_at(s, cfg.train)
        if sim is None:
            return engine.train_step(batches, lr).loss
        with sim.watch():
            return engine.train_step(batches, lr).loss

    resident = ResidentEngine(cfg, torch.device("cpu"), torch.float32)
    want = [resident.train_step(batches_for(s, cfg, 251), lr_at(s, cfg.train)).loss
            for s in range(3)]  # fmt: skip
    first, sim = make()
    try:
        losses = [step(first, sim, s) for s in range(2)]
        saved = {k: v.clone() for _, tensors in first.state_files() for k, v in tensors.items()}
        steps = first.optimizer_steps()
    finally:
        first.close()
    engine, sim = make()
    try:
        engine.load_state(saved.__getitem__, True, steps)
        losses.append(step(engine, sim, 2))
        engine.wait_idle()
        got = engine.named_parameters()
        masters = [shared.read() for shared in engine.shared_units()]
    finally:
        engine.close()
    assert sim is None or sim.violations == []
    assert losses == pytest.approx(want, rel=1e-5)
    for name, p in resident.model.named_parameters():
        assert rel_err(got[name], p.detach()) <= 1e-5, name
    for unit, master in zip(engine.units, masters, strict=True):
        assert torch.equal(master[_padding(unit)], torch.zeros(int(_padding(unit).sum())))
