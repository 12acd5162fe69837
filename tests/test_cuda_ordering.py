"""CudaBackend's stream ordering, checked on the CPU (tests/fake_cuda.py).

    pytest tests/test_cuda_ordering.py

The real CudaBackend drives the swap engine through streams and events faked on the CPU;
a race detector checks every device-memory access against the waits the code asked for:
no slot is overwritten before the compute that read it has recorded its event and the
copy stream waited for it, no slot is read before its copy's event, no gradient leaves
before the compute that wrote it. The numbers equal the CPU backend's, and a backend with
one wait removed is caught.
"""

from __future__ import annotations

import pytest
import torch

from atom.optim import lr_at
from atom.swap.backend import CpuBackend, CudaBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.fake_cuda import cuda_backend
from tests.test_swap_equivalence import batches_for, rel_err

CASES = {
    "exact, unit-major": {},
    "eager, micro-major": {"update": "eager", "order": "micro"},
    "no clipping, grad accumulation": {"order": "unit"},
    "recompute + offloaded inputs": {"checkpoint": True, "offload_activations": True},
    "resident units, prefetch 2": {"resident_units": 1, "prefetch": 2},
    "compact state, bf16": {"state": "compact"},
}


def _train(cfg, backend, sim=None, steps: int = 3):
    dtype = torch.bfloat16 if cfg.swap.state == "compact" else torch.float32
    engine = SwapEngine(cfg, backend, dtype)
    try:
        losses = []
        for step in range(steps):
            batches = batches_for(step, cfg)
            if sim is None:
                losses.append(engine.train_step(batches, lr_at(step, cfg.train)).loss)
            else:
                with sim.watch():
                    losses.append(engine.train_step(batches, lr_at(step, cfg.train)).loss)
        engine.wait_idle()
        with sim.watch() if sim is not None else _nothing():
            val = engine.evaluate(batches_for(99, cfg))
        return losses, val, engine.named_parameters()
    finally:
        engine.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _config(swap: dict):
    train = {"grad_accum": 2, "grad_clip": 0.0 if swap.get("order") == "unit" else 1.0}
    return tiny_config(model={"arch": "llama", "n_kv_head": 2}, train=train,
                       swap={"layers_per_unit": 1, "prefetch": 1, **swap})  # fmt: skip


@pytest.mark.parametrize("swap", CASES.values(), ids=CASES.keys())
def test_cuda_backend_orders_every_copy_and_read(monkeypatch, swap):
    cfg = _config(swap)
    want_losses, want_val, want = _train(cfg, CpuBackend())
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    losses, val, params = _train(cfg, backend, sim)
    assert sim.violations == []
    assert sim.ops > 1000  # the steps ran under the checker
    assert losses == pytest.approx(want_losses, rel=1e-6) and val == pytest.approx(want_val)
    for name, p in want.items():
        assert rel_err(params[name], p) <= 1e-6, name


def test_offloaded_inputs_reuse_their_pinned_buffers_and_are_counted(monkeypatch):
    """The offload pool is page-locked in the first step and reused after: the pinned
    bytes grow by exactly the offloaded inputs once, then not at all (the device side of
    offload and fetch is ordered on the compute stream; the pinned buffers themselves are
    host memory, which the checker does not track)."""
    cfg = _config({"checkpoint": True, "offload_activations": True, "order": "unit"})
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        before = backend.pinned_bytes
        seen = []
        for step in range(3):
            with sim.watch():
                engine.train_step(batches_for(step, cfg), 1e-3)
            seen.append(backend.pinned_bytes)
    finally:
        engine.close()
    n_inputs = (len(engine.units) - 2) * cfg.train.grad_accum  # unit-major: all in flight
    hidden = cfg.train.micro_batch * cfg.model.seq_len * cfg.model.d_model * 4
    assert seen[0] - before >= n_inputs * hidden  # each page-aligned
    assert seen[0] - before <= n_inputs * (hidden + 4096)
    assert seen[1] == seen[2] == seen[0] and sim.violations == []


def test_timed_copies_keep_the_order_and_give_a_bandwidth(monkeypatch):
    """gpu_check's H2D timing (events around each copy) changes no ordering."""
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    backend.time_copies = True
    _train(_config({}), backend, sim, steps=2)
    assert sim.violations == [] and len(backend._timed) >= 2 * 5  # every unit, every step
    assert backend.copy_gbps() > 0


def test_a_copy_that_does_not_wait_for_the_slots_last_reader_is_caught(monkeypatch):
    """The copy stream skips `wait_event(after)`: the next unit's copy overwrites a slot
    the compute stream may still be reading."""
    real_h2d = CudaBackend.h2d
    monkeypatch.setattr(
        CudaBackend, "h2d", lambda self, dst, src, after, ready, locks=(): real_h2d(
            self, dst, src, None, ready, locks)
    )  # fmt: skip
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    _train(_config({}), backend, sim, steps=2)
    assert any("overwrites" in v for v in sim.violations), sim.violations[:3]


def test_compute_that_does_not_wait_for_the_copy_is_caught(monkeypatch):
    """wait_compute forgets `compute.wait_event(copy)`: a slot read before it landed."""
    from atom.swap import backend as backend_mod

    monkeypatch.setattr(CudaBackend, "wait_compute", lambda self, t: backend_mod._wait_issued(t))
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    _train(_config({}), backend, sim, steps=1)
    assert any("reads" in v for v in sim.violations), sim.violations[:3]


def test_a_gradient_copied_out_before_it_is_written_is_caught(monkeypatch):
    """The D2H stream waits for no compute marker: the copy stream reads a gradient the
    compute stream may not have finished writing."""
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    monkeypatch.setattr(backend.d2h_stream, "wait_event", lambda event: None)
    _train(_config({}), backend, sim, steps=1)
    assert any("reads" in v for v in sim.violations), sim.violations[:3]


@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
def test_a_non_contiguous_gradient_is_copied_out_after_it_is_flattened(monkeypatch, as_list):
    """d2h flattens a non-contiguous gradient with a copy on the compute stream: the D2H
    stream must wait for that copy, not only for a marker the caller recorded before it
    (as the engine's `_post_grads` does: `d2h(grad, backend.record())`)."""
    backend, sim = cuda_backend(monkeypatch, 0, watch_host=False)
    backend.size_staging(256, torch.float32)
    try:
        with sim.watch():
            grad = torch.arange(96.0).reshape(12, 8) * 2  # written by the compute stream
            src = grad.t()  # (8, 12), not contiguous: reshape(-1) copies
            t = backend.d2h([src, grad] if as_list else src, backend.record())
        landed = []
        with sim.host_watch():
            for _offset, host in backend.host_pieces(t):
                landed.append(host.clone())
        backend.release_host(t)
        want = torch.cat([src.reshape(-1), grad.reshape(-1)] if as_list else [src.reshape(-1)])
        assert torch.equal(torch.cat(landed), want)
        assert sim.violations == []
    finally:
        backend.close()
