"""Units updated on the card (swap.card_update) keep no host gradient: their gradient is
summed and used on the device, so atom/swap/host_store.py allocates an empty one.

    pytest tests/test_card_host_grad.py

The reference is the store as it was before: a host gradient for every unit (the store
built as if no unit were card-updated; on the CPU backend that changes nothing else).
Training, checkpoints and resume give the same bits with and without it; the store is
smaller by exactly the card units' gradients, and so is the trainer's host-RAM estimate.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from atom.config import ConfigError
from atom.optim import lr_at
from atom.profiler.analysis import ModelAnalysis
from atom.run.run_config import card_grad_bytes, host_bytes_needed
from atom.swap import engine as engine_module
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from atom.swap.host_store import HostStore
from tests.test_card_update import _config, _flat
from tests.test_swap_equivalence import batches_for

STEPS = 2  # eager: the second step clips by the first one's norm
CARDS = ["all", "1-2", "none"]
CARD_UNITS = {"all": {0, 1, 2, 3, 4}, "1-2": {1, 2}, "none": set()}  # embed, 3 blocks, head
# compact and bf16: compute is master
DTYPE = {"fp32": torch.float32, "compact": torch.bfloat16, "bf16": torch.bfloat16}


def _cfg(card: str, state: str, update: str = "exact", order: str = "unit", accum: int = 2):
    swap = {"state": state, "compile_update": False}
    return _config(card, 0.05, update, order, accum, 0, swap=swap)  # 0.05 clips every step


def _store_as_before(units, backend, dtype, state, paged, card, *rest):
    """The engine's HostStore as it was: a host gradient for every unit (`rest`: what else
    the engine passes, as it is)."""
    return HostStore(units, backend, dtype, state, paged, frozenset(), *rest)


def _run(cfg, dtype, steps: int = STEPS, then=None):
    engine = SwapEngine(cfg, CpuBackend(), dtype)
    try:
        losses = [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                  for s in range(steps)]  # fmt: skip
        out = losses, _flat(dict(engine.state_files())), engine.store.nbytes()
        return out if then is None else (*out, then(engine))
    finally:
        engine.close()


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("state", ["fp32", "compact", "bf16"])
@pytest.mark.parametrize("card", CARDS)
def test_units_updated_on_the_card_have_no_host_gradient(state, card, monkeypatch):
    """Every card unit's host gradient is empty, every other unit's whole, after a step;
    the store is smaller than the one with every unit's gradient by exactly the card
    units' gradient bytes (n_total elements of the master's dtype each)."""
    cfg = _cfg(card, state)

    def grads(engine):
        return engine.card_units, [b.grad.numel() for b in engine.store.buffers]

    *_, nbytes, (units, numels) = _run(cfg, DTYPE[state], steps=1, then=grads)
    monkeypatch.setattr(engine_module, "HostStore", _store_as_before)
    *_, full, (_, n_total) = _run(cfg, DTYPE[state], steps=1, then=grads)
    assert units == CARD_UNITS[card]
    assert numels == [0 if u in units else n for u, n in enumerate(n_total)]
    itemsize = 4 if state == "fp32" else 2  # the gradient has the master's dtype
    assert full - nbytes == sum(n_total[u] for u in units) * itemsize


@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_all_units_on_the_card_drop_the_gradients_share_of_the_store(state):
    """fp32 state and compute: master doubles as the compute copy, so the gradient was
    half the store; compact with bf16 compute: a third (bf16 master, int16 remainder)."""
    nbytes = {card: _run(_cfg(card, state), DTYPE[state], steps=1)[2] for card in ("all", "none")}
    assert nbytes["all"] * (2 if state == "fp32" else 1.5) == nbytes["none"]


CASES = list(itertools.product(["fp32", "compact"], ["exact", "eager"], ["unit", "micro"]))


@pytest.mark.parametrize("state,update,order", CASES)
def test_training_without_the_host_gradient_is_bit_for_bit_as_before(
    state, update, order, monkeypatch
):
    """Losses and every checkpointed tensor (weights, both moments) equal the run with a
    host gradient for every unit, for all, some and no units on the card (grad_accum 2)."""
    runs = {card: _run(_cfg(card, state, update, order), DTYPE[state]) for card in CARDS}
    monkeypatch.setattr(engine_module, "HostStore", _store_as_before)
    before = {card: _run(_cfg(card, state, update, order), DTYPE[state]) for card in CARDS}
    for card in CARDS:
        assert runs[card][0] == before[card][0], card
        _assert_same(runs[card][1], before[card][1])
        assert (runs[card][2] < before[card][2]) == (card != "none")
    if state == "fp32":  # and the card update still equals the host update there
        for card in ("all", "1-2"):
            assert runs[card][0] == runs["none"][0]
            _assert_same(runs[card][1], runs["none"][1])


def test_the_reference_store_has_a_host_gradient_for_every_unit(monkeypatch):
    """What the tests compare against: the host gradients the card units had before."""
    monkeypatch.setattr(engine_module, "HostStore", _store_as_before)
    cfg = _cfg("all", "fp32")
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        assert engine.card_units == {0, 1, 2, 3, 4}
        assert all(b.grad.numel() == b.spec.n_total > 0 for b in engine.store.buffers)
    finally:
        engine.close()


@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_a_card_units_optimizer_refuses_a_host_step(state):
    """Its update runs on the device only: a host step would have no gradient to read."""
    engine = SwapEngine(_cfg("1-2", state), CpuBackend(), DTYPE[state])
    try:
        with pytest.raises(AssertionError, match="no host gradient"):
            engine.optimizers[1].step(1e-3)
    finally:
        engine.close()


@pytest.mark.parametrize("state,update", [("fp32", "exact"), ("compact", "eager")])
def test_a_checkpoint_of_card_units_resumes_exactly(state, update, tmp_path, monkeypatch):
    """Saved after 2 steps and loaded into a new engine (weights, moments, run state), it
    trains the next 2 steps as the unbroken engine does; and the checkpoint holds what
    the engine with host gradients everywhere saved."""
    from atom.store.checkpoint import load_checkpoint, save_checkpoint

    cfg, dtype = _cfg("1-2", state, update), DTYPE[state]

    def train(engine, steps):
        return [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in steps]

    a = SwapEngine(cfg, CpuBackend(), dtype)
    b = SwapEngine(cfg, CpuBackend(), dtype, init=False)
    try:
        train(a, range(2))
        meta = {"optimizer_steps": a.optimizer_steps(), "run_state": a.run_state()}
        path = save_checkpoint(tmp_path / "now", 2, a.state_files(), meta)
        want = train(a, range(2, 4)), _flat(dict(a.state_files()))
        ckpt = load_checkpoint(path)
        b.load_state(ckpt.get, True, ckpt.meta["optimizer_steps"])
        b.load_run_state(ckpt.meta["run_state"])
        got = train(b, range(2, 4)), _flat(dict(b.state_files()))
    finally:
        a.close()
        b.close()
    assert got[0] == want[0]
    _assert_same(got[1], want[1])
    monkeypatch.setattr(engine_module, "HostStore", _store_as_before)
    ref = SwapEngine(cfg, CpuBackend(), dtype)
    try:
        train(ref, range(2))
        old = save_checkpoint(tmp_path / "before", 2, ref.state_files(), {})
    finally:
        ref.close()
    saved, before = load_checkpoint(path), load_checkpoint(old)
    assert sorted(saved.names()) == sorted(before.names())
    for name in before.names():
        assert torch.equal(saved.get(name), before.get(name)), name


@functools.cache
def _held_after_a_step(card: str, state: str) -> int:
    """Host bytes of model state the engine holds after a step: the store, the moments
    (compact: their codes and scales, and the update's scratch)."""

    def held(engine):
        engine.wait_idle()
        total = engine.store.nbytes()
        if state != "fp32":  # compact, bf16: 8-bit moments and the update's scratch
            total += sum(o.nbytes() for o in engine.optimizers)
            return total + engine.optimizers[0].scratch.nbytes
        keys = ("exp_avg", "exp_avg_sq")
        return total + sum(o.state_flat(k).nbytes for o in engine.optimizers for k in keys)

    return _run(_cfg(card, state), torch.float32, steps=1, then=held)[3]


@pytest.mark.parametrize("state", ["fp32", "compact", "bf16"])
@pytest.mark.parametrize("card", CARDS)
def test_the_host_ram_estimate_leaves_out_the_card_units_gradients(state, card):
    """host_bytes_needed (the trainer's up-front refusal) against what the engine holds
    after a step: the card units' gradients leave both alike; fp32 exactly, compact up to
    its moments' padding to whole blocks (tests/test_profiler.py), the same with or
    without units on the card."""
    cfg = _cfg(card, state)
    got, everywhere = _held_after_a_step(card, state), _held_after_a_step("none", state)
    estimate = host_bytes_needed(cfg, torch.float32)[1]
    full = ModelAnalysis.of(cfg).host_bytes(torch.float32, state)  # every unit's gradient
    assert full - estimate == everywhere - got == card_grad_bytes(cfg)
    assert (card_grad_bytes(cfg) > 0) == (card != "none")
    if state == "fp32":
        assert estimate == got
    else:
        assert abs(estimate - got) <= 600 * len(CARD_UNITS["all"]), (estimate, got)


def test_a_bad_card_unit_list_is_refused_by_the_estimate_as_by_the_engine():
    with pytest.raises(ConfigError, match="unit 9 does not exist"):
        host_bytes_needed(_cfg("9", "fp32"), torch.float32)


@pytest.mark.parametrize("state", ["fp32", "compact", "bf16"])
@pytest.mark.parametrize("card", ["all", "1-2"])
def test_with_the_nvme_tier_card_units_have_no_host_gradient_either(state, card, tmp_path):
    """The tier pages master and moments; RAM keeps the compute copies and the gradients,
    none for card units: what the engine holds after a step (RAM slots and scratch
    included) is the trainer's estimate, exactly."""
    swap = {"state": state, "compile_update": False, "disk_dir": str(tmp_path)}
    cfg = _config(card, 0.05, "exact", "unit", 2, 0, swap=swap)

    def held(engine):
        engine.wait_idle()
        assert [b.grad.numel() == 0 for b in engine.store.buffers] == [
            u in CARD_UNITS[card] for u in range(len(engine.units))
        ]
        total = engine.store.nbytes() + engine.tier.slot_bytes
        return total + (engine.optimizers[0].scratch.nbytes if state != "fp32" else 0)

    got = _run(cfg, torch.float32, steps=1, then=held)[3]
    assert host_bytes_needed(cfg, torch.float32)[1] == got


@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_with_the_nvme_tier_training_is_bit_for_bit_as_before(state, tmp_path, monkeypatch):
    """Card units' state paged by the tier: the same bits as with every host gradient."""

    def run(name):
        (tmp_path / name).mkdir()
        swap = {"state": state, "compile_update": False, "disk_dir": str(tmp_path / name)}
        return _run(_config("1-2", 0.05, "eager", "micro", 2, 0, swap=swap), DTYPE[state])

    now = run("now")
    monkeypatch.setattr(engine_module, "HostStore", _store_as_before)
    before = run("before")
    assert now[0] == before[0]
    _assert_same(now[1], before[1])


@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_a_run_with_card_units_resumes_as_if_unbroken(state, tmp_path, text_dataset):
    """The trainer's own checkpoint and --resume path, card units on: the split run's
    losses and final weights equal the unbroken run's."""
    from atom.run.train import Trainer
    from tests.test_train_resume import final_params, losses

    cfg = _config("1-2", 0.05, "eager", "micro", 2, 0,
                  swap={"state": state, "compile_update": False},
                  train={"max_steps": 4, "data": str(text_dataset)})  # fmt: skip
    Trainer(cfg, tmp_path / "full", progress=False).run()
    Trainer(cfg, tmp_path / "split", progress=False).run(max_steps=2)
    Trainer(cfg, tmp_path / "split", resume=tmp_path / "split", progress=False).run()
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    _assert_same(final_params(tmp_path / "split"), final_params(tmp_path / "full"))
