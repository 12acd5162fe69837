"""The CUDA path's failure and shutdown paths, and the fake CUDA's host-memory checks, on
the CPU (tests/fake_cuda.py).

    pytest tests/test_cuda_faults.py

A host worker that fails must end the step within seconds with its own error (it used to
keep the D2H staging buffers of the landings queued behind it, and the training thread
waited 10 minutes for one); an abandoned step must not free a host buffer a copy is still
writing; a closed engine must let go of its page-locked memory at once; host waits must
sleep, not spin. The fake CUDA must catch what those fixes guard against when it is
planted back: a host read before its copy completed, a staging buffer reused while a
landing still reads it, a buffer freed under a pending copy, a gradient freed without
record_stream.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

import pytest
import torch

from atom.optim import lr_at
from atom.swap.backend import CpuBackend, CudaBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.fake_cuda import FakeEvent, cuda_backend, release_staging_early
from tests.test_swap_equivalence import batches_for, rel_err


def _config(train: dict | None = None, **swap):
    return tiny_config(
        model={"arch": "llama", "n_kv_head": 2, "n_layer": 4},
        train={"grad_accum": 2, "grad_clip": 1.0, **(train or {})},
        swap={"layers_per_unit": 1, "prefetch": 1, **swap},
    )


def _steps(engine, cfg, sim, steps: int = 2) -> list[float]:
    losses = []
    for step in range(steps):
        with sim.watch():
            losses.append(engine.train_step(batches_for(step, cfg), lr_at(step, cfg.train)).loss)
    engine.wait_idle()
    return losses


def _reference(cfg, steps: int = 2):
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        losses = [
            engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in range(steps)
        ]
        return losses, engine.named_parameters()
    finally:
        engine.close()


# ---------------------------------------------------------------- finding 1: no hang


def test_a_failing_host_worker_ends_the_step_in_seconds_with_its_error(monkeypatch):
    """The first update fails once the training thread holds every staging chunk and
    waits for another; landings are queued behind it. The step must end with the
    update's own error, within seconds (it used to wait 600 s, then raise queue.Empty)."""
    cfg = _config(train={"grad_clip": 0.0, "grad_accum": 1})  # updates run as grads land
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    engine = SwapEngine(cfg, backend, torch.float32)

    def failing_update(u, coef, lr):
        t0 = time.monotonic()  # until every staging chunk is taken: the worst case
        while not backend._staging.empty() and time.monotonic() - t0 < 5:
            time.sleep(0.005)
        raise OSError("planted: the optimizer step failed")

    monkeypatch.setattr(engine, "_update", failing_update)
    outcome: dict = {}

    def step() -> None:
        try:
            with sim.watch():
                engine.train_step(batches_for(0, cfg), 1e-3)
        except BaseException as err:  # what the training thread would see
            outcome["error"] = err

    t0 = time.monotonic()
    runner = threading.Thread(target=step, daemon=True)
    runner.start()
    runner.join(timeout=30)
    assert not runner.is_alive(), "the step hung behind a failed host worker"
    assert time.monotonic() - t0 < 15
    err = outcome.get("error")
    assert isinstance(err, RuntimeError) and "planted" in str(err), repr(err)
    assert isinstance(err.__cause__, OSError)
    # every staging buffer came back: nothing leaked for a later step or the close
    assert backend._staging.qsize() == backend._staging_chunks
    with pytest.raises(RuntimeError, match="planted"):  # close says it again, and still
        engine.close()
    assert sim.registered == {}  # lets go of the pinned memory


# ---------------------------------------------------------------- finding 5: sleeping waits


def test_a_host_wait_on_a_spinning_event_is_caught(monkeypatch):
    """Events made without blocking=True busy-wait in cudaEventSynchronize; the fake flags
    a host wait on one (the engine's own runs, in test_cuda_ordering, have none)."""

    class Spinning(FakeEvent):
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            super().__init__(enable_timing, False, interprocess)

    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    monkeypatch.setattr(torch.cuda, "Event", Spinning)
    cfg = _config()
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        _steps(engine, cfg, sim, steps=1)
    finally:
        engine.close()
    assert any("blocking=True" in v for v in sim.violations), sim.violations[:3]


def test_every_event_a_host_thread_waits_on_is_blocking(monkeypatch):
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    cfg = _config()
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        _steps(engine, cfg, sim)
    finally:
        engine.close()
    assert sim.violations == []


# ---------------------------------------------------------------- finding 6: abandoned steps


def _abandon_with_offloads(monkeypatch, plant: bool):
    """Ctrl+C in the backward of a step whose unit inputs were offloaded to host buffers
    (torch's pinned allocator: cudaHostRegister refused, so no arena keeps them)."""
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    sim.fail_host_register = True
    if plant:  # what the abandon did before: drop the step's state with copies in flight
        monkeypatch.setattr(backend, "synchronize", lambda: None)
        monkeypatch.setattr(backend, "reclaim", lambda t: None)
    cfg = _config({"grad_accum": 4}, checkpoint=True, offload_activations=True, order="unit")
    engine = SwapEngine(cfg, backend, torch.float32)
    # Stop in unit 1's forward, after 3 of its 4 micro-batches offloaded their inputs: no
    # slot was released since, so no later copy waited for them (which would complete them)
    visits = iter(range(10**6))
    try:
        try:
            with sim.watch():
                engine.train_step(batches_for(0, cfg), 1e-3, stop=lambda: next(visits) > 4)
            raise AssertionError("the step was not abandoned")
        except KeyboardInterrupt:
            pass
        gc.collect()
        sim.sweep_device()
        with sim.watch():  # the engine trains on after it
            engine.train_step(batches_for(1, cfg), 1e-3)
        engine.wait_idle()
    finally:
        engine.close()
    return sim


def test_an_abandoned_step_frees_no_host_buffer_a_copy_is_writing(monkeypatch):
    sim = _abandon_with_offloads(monkeypatch, plant=False)
    assert sim.violations == []


def test_a_planted_free_of_an_offload_buffer_with_a_copy_pending_is_caught(monkeypatch):
    sim = _abandon_with_offloads(monkeypatch, plant=True)
    assert any("freed while compute's copy" in v for v in sim.violations), sim.violations[:3]


# ---------------------------------------------------------------- finding 7: close


def test_close_releases_pinned_memory_and_slots_without_a_collection(monkeypatch):
    cfg = _config(checkpoint=True, offload_activations=True)
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    gc.collect()
    gc.disable()  # what close leaves to a collection would stay
    try:
        engine = SwapEngine(cfg, backend, torch.float32)
        _steps(engine, cfg, sim, steps=1)
        assert sim.registered and backend.pinned_bytes > 0
        slot = weakref.ref(engine.slots.slots[0].flat)
        engine.close()
        assert sim.registered == {}, "page-locked memory outlived close()"
        assert backend.pinned_bytes == 0 and slot() is None
        gone = weakref.ref(engine)
        del engine
        assert gone() is None, "a reference cycle keeps the closed engine alive"
    finally:
        gc.enable()
    assert sim.violations == []  # unregistered once each, after the copies were done


def _close_with_a_copy_in_flight(monkeypatch, plant: bool):
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    cfg = _config()
    engine = SwapEngine(cfg, backend, torch.float32)
    _steps(engine, cfg, sim, steps=1)
    with sim.watch():  # a gradient copy into a staging buffer that no one waited for
        grad = sim.device_tensor(torch.ones(64))
        backend.d2h(grad, backend.record())
    if plant:  # what close did before: unregister at once
        monkeypatch.setattr(backend, "synchronize", lambda: None)
    engine.close()
    return sim


def test_close_waits_for_copies_before_unlocking_their_pages(monkeypatch):
    assert _close_with_a_copy_in_flight(monkeypatch, plant=False).violations == []


def test_a_planted_unregister_under_a_pending_copy_is_caught(monkeypatch):
    sim = _close_with_a_copy_in_flight(monkeypatch, plant=True)
    assert any("cudaHostUnregister of pages" in v for v in sim.violations), sim.violations[:3]


# ---------------------------------------------------------------- the fake itself


def test_late_copies_and_a_refused_page_lock_still_train_exactly(monkeypatch, caplog):
    """Copies land 20 ms after they are issued (host waits sleep for them; a read before
    the wait would see NaN), and cudaHostRegister is refused (torch's pinned allocator
    is used buffer by buffer): the numbers are the CPU backend's."""
    cfg = _config(checkpoint=True, offload_activations=True)
    want_losses, want = _reference(cfg)
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    sim.copy_delay_s, sim.fail_host_register = 0.02, True
    monkeypatch.setattr("atom.swap.pinned._warned", False)
    with caplog.at_level(logging.WARNING, logger="atom.swap.pinned"):
        engine = SwapEngine(cfg, backend, torch.float32)
    try:
        losses = _steps(engine, cfg, sim)
        params = engine.named_parameters()
        assert backend.pinned_bytes > 0 and sim.registered == {}
    finally:
        engine.close()
    assert "pinning buffer by buffer" in caplog.text
    assert sim.violations == []
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for name, p in want.items():
        assert rel_err(params[name], p) <= 1e-6, name


def _one_late_step(monkeypatch, cfg, delay: float):
    """One step over the fake CUDA with copies landing `delay` s late; the simulator."""
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    sim.copy_delay_s = delay
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        with sim.watch():
            engine.train_step(batches_for(0, cfg), 1e-3)
        engine.wait_idle()
    finally:
        engine.close()
    return sim


def test_a_planted_read_before_the_copy_completes_is_caught(monkeypatch):
    """host_pieces forgets a chunk's D2H event: the host worker reads a staging chunk the
    copy is still writing."""
    from atom.swap import backend as backend_mod

    def no_wait(self, t):
        backend_mod._wait_issued(t)
        for offset, host, _ev, buf in t.pieces:
            yield offset, host
            self._give_back(t, buf)

    monkeypatch.setattr(CudaBackend, "host_pieces", no_wait)
    sim = _one_late_step(monkeypatch, _config(), delay=0.01)
    assert any("on the host reads" in v and "before waiting" in v for v in sim.violations), (
        sim.violations[:3]
    )


def test_a_planted_reuse_of_a_staging_chunk_is_caught(monkeypatch):
    """d2h hands its staging chunks back as soon as their copies are issued: the next
    gradient copy overwrites them while the landing that owns them has not read them."""
    release_staging_early(monkeypatch)
    # the landing sleeps in its wait while the next copy is issued
    sim = _one_late_step(monkeypatch, _config(train={"grad_clip": 0.0}), delay=0.2)
    assert any("on the host reads" in v for v in sim.violations), sim.violations[:3]


def test_a_gradient_freed_without_record_stream_is_caught(monkeypatch):
    """The D2H stream reads gradients the compute stream allocated; without
    record_stream the allocator could hand their memory to the next kernel mid-copy."""
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    # The copies land 1 s late: the host worker's wait on them cannot complete before the
    # training thread drops the gradients, even on a loaded box (with instant copies the
    # worker could see a copy done first, which makes the free legitimately safe: CI did).
    sim.copy_delay_s = 1.0
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    cfg = _config()
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        _steps(engine, cfg, sim, steps=1)
        gc.collect()
        sim.sweep_device()
    finally:
        engine.close()
    assert any("record_stream" in v for v in sim.violations), sim.violations[:3]
