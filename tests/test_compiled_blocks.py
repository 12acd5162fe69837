"""train.compile_blocks: the blocks under torch.compile train as the eager ones do; a
compile that fails says so once and leaves eager blocks; packed documents and generation
run the eager forward."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo

from atom.config import ConfigError
from atom.model import build_model, compiled_blocks, materialize
from atom.model.documents import Documents
from atom.optim import lr_at
from atom.resident.engine import ResidentEngine
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_swap_equivalence import batches_for, rel_err

STEPS = 3


def _train(engine, cfg, steps=STEPS) -> list[float]:
    losses = []
    for step in range(steps):
        losses.append(engine.train_step(batches_for(step, cfg), lr_at(step, cfg.train)).loss)
    return losses


def _swap(cfg):
    return SwapEngine(cfg, CpuBackend(), torch.float32)


def _trained(cfg) -> tuple[list[float], dict, bool]:
    """A swapped engine's losses over STEPS steps, its weights after, whether it compiled."""
    engine = _swap(cfg)
    try:
        return _train(engine, cfg), engine.named_parameters(), engine.blocks_compiled
    finally:
        engine.close()


def _resident(cfg):
    return ResidentEngine(cfg, torch.device("cpu"), torch.float32)


class CountingCompile:
    """torch.compile's stand-in: the function itself, counting the calls it serves."""

    def __init__(self):
        self.calls = 0

    def __call__(self, fn, **_):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


@pytest.mark.parametrize("make", [_swap, _resident], ids=["swap", "resident"])
def test_plain_calls_take_the_compiled_forward_and_documents_the_eager_one(make, monkeypatch):
    fake = CountingCompile()
    monkeypatch.setattr(compiled_blocks.torch, "compile", fake)
    cfg = tiny_config(model={"n_layer": 2}, train={"compile_blocks": "on"})
    engine = make(cfg)
    try:
        assert engine.blocks_compiled
        trial = fake.calls
        assert trial == 2  # the trial: a no-grad forward, a forward with its backward
        _train(engine, cfg, 1)
        # every block: the forward (checkpointed: and its recompute in the backward)
        assert fake.calls > trial
        block = engine.model.blocks[0]
        before = fake.calls
        x = torch.randn(2, 8, cfg.model.d_model)
        docs = Documents(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2))
        if isinstance(engine, ResidentEngine):  # real weights: the two paths agree
            torch.testing.assert_close(block(x, docs=None), type(block).forward(block, x))
            assert fake.calls == before + 1
            block(x, docs=docs)
            assert fake.calls == before + 1  # packed documents: eager
    finally:
        getattr(engine, "close", lambda: None)()


def test_off_and_auto_on_a_cpu_leave_the_blocks_alone(monkeypatch):
    fake = CountingCompile()
    monkeypatch.setattr(compiled_blocks.torch, "compile", fake)
    for setting in ("off", "auto"):
        cfg = tiny_config(train={"compile_blocks": setting})
        engine = _swap(cfg)
        try:
            assert not engine.blocks_compiled
            assert not any(compiled_blocks.is_compiled(b) for b in engine.model.blocks)
            _train(engine, cfg, 1)
        finally:
            engine.close()
    assert fake.calls == 0
    assert compiled_blocks.wanted("auto", torch.device("cuda"))
    assert not compiled_blocks.wanted("off", torch.device("cuda"))


def test_a_bad_setting_is_one_clear_error():
    with pytest.raises((ConfigError, ValueError), match="compile_blocks"):
        tiny_config(train={"compile_blocks": "yes"})


def test_a_compile_that_fails_says_so_once_and_trains_eagerly(monkeypatch, caplog):
    """The failure comes at the first call, as Inductor's do (a missing C++ compiler):
    the trial catches it before any step, and training equals the eager engine's."""

    def broken(fn, **_):
        def call(*args, **kwargs):
            raise RuntimeError("Compiler: cc is not found\nmore detail")

        return call

    expected, expected_params, _ = _trained(tiny_config(train={"compile_blocks": "off"}))
    monkeypatch.setattr(compiled_blocks.torch, "compile", broken)
    cfg = tiny_config(train={"compile_blocks": "on"})
    with caplog.at_level(logging.WARNING, logger="atom.model.compiled_blocks"):
        engine = _swap(cfg)
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        line = warnings[0].getMessage()
        assert "do not compile" in line and "cc is not found" in line
        assert "compile_blocks=off" in line and "\n" not in line
        assert not engine.blocks_compiled
        assert _train(engine, cfg) == expected
        got = engine.named_parameters()
        assert all(torch.equal(got[k], v) for k, v in expected_params.items())
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,checkpoint", [("gpt", True), ("llama", False)], ids=["gpt-ckpt", "llama"]
)
def test_compiled_blocks_train_as_the_eager_ones(arch, checkpoint):
    """The CPU twin of the CUDA default: Inductor's blocks against eager ones, a few steps
    of the swap engine (checkpointed: the no-grad forward and the recompute are separate
    graphs), and the resident engine under the same setting."""
    shape = {"arch": arch, "n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16}
    swap = {"checkpoint": checkpoint}
    eager_cfg = tiny_config(model=shape, swap=swap, train={"compile_blocks": "off"})
    cfg = tiny_config(model=shape, swap=swap, train={"compile_blocks": "on"})
    expected, expected_params, _ = _trained(eager_cfg)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    engine = _swap(cfg)
    try:
        assert engine.blocks_compiled
        trial_graphs = graphs["unique_graphs"]
        losses, got = _train(engine, cfg), engine.named_parameters()
        # the trial compiled every graph the steps run: none compiles mid-step, where a
        # failure could no longer fall back
        assert graphs["unique_graphs"] == trial_graphs
    finally:
        engine.close()
    assert losses == pytest.approx(expected, rel=1e-4)
    assert max(rel_err(got[k], v) for k, v in expected_params.items()) < 1e-3
    resident = _resident(cfg)
    assert resident.blocks_compiled
    assert _train(resident, cfg) == pytest.approx(expected, rel=1e-4)


def _compiles(cfg) -> bool:
    engine = _swap(cfg)
    engine.close()
    return engine.blocks_compiled


def test_blocks_past_dynamos_recompile_limit_are_not_called_compiled(caplog):
    """Dynamo keeps a function's graphs per process, and past its recompile limit runs it
    eagerly without an error (a sweep building engine after engine at other shapes):
    such blocks are not called compiled, and the warning says why; an engine whose
    calls a graph already compiled serves is compiled."""
    shape = {"arch": "gpt", "n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16}
    first, other = (tiny_config(model=shape, train={"compile_blocks": "on", "micro_batch": b})
                    for b in (2, 3))  # fmt: skip
    torch._dynamo.reset()
    try:
        # room for one engine's two graphs (the no-grad forward, the one with a backward)
        limit = torch._dynamo.config.patch(recompile_limit=2)
        with limit, caplog.at_level(logging.WARNING, logger="atom.model.compiled_blocks"):
            compiled = [_compiles(cfg) for cfg in (first, other, first)]
    finally:
        torch._dynamo.reset()  # no later test meets this code past its limit
    assert compiled == [True, False, True]
    ours = [r for r in caplog.records if r.name == "atom.model.compiled_blocks"]
    (warning,) = [r.getMessage() for r in ours if r.levelno == logging.WARNING]
    assert "recompile limit" in warning and "running them eagerly" in warning


def test_a_dynamo_that_runs_the_blocks_eagerly_is_not_called_compiled(caplog):
    """torch.compile's function runs, without an error, the forward as it is (Dynamo
    disabled): no compiled graph serves the blocks, so they are not called compiled."""
    cfg = tiny_config(model={"n_layer": 2}, train={"compile_blocks": "on"})
    disabled = torch._dynamo.config.patch(disable=True)
    with disabled, caplog.at_level(logging.WARNING, logger="atom.model.compiled_blocks"):
        assert not _compiles(cfg)
    assert "eagerly (0 graphs compiled)" in caplog.text


def test_running_out_of_device_memory_in_the_trial_is_not_called_a_compile_failure(
    monkeypatch,
):
    """One block at the step's micro-batch not fitting is the plan's problem, not the
    compiler's: the error goes up as it is (no warning that blames the compiler, no
    eager fallback that would run out of memory a moment later)."""

    def oom(fn, **_):
        def call(*args, **kwargs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

        return call

    monkeypatch.setattr(compiled_blocks.torch, "compile", oom)
    cfg = tiny_config(train={"compile_blocks": "on"})
    net = materialize(build_model(cfg.model), 0, device=torch.device("cpu"))
    example = compiled_blocks.hidden_state(cfg, torch.device("cpu"), torch.float32)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        compiled_blocks.compile_blocks(list(net.blocks), example)
    assert not any(compiled_blocks.is_compiled(b) for b in net.blocks)
