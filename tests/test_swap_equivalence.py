"""Swapped training equals resident (plain PyTorch) training, and the resident bound holds.

    pytest tests/test_swap_equivalence.py

fp32 on the CPU backend: same init, same batches, same optimizer; losses and final
parameters must agree to 1e-5 relative for several unit sizes, prefetch depths,
gradient accumulation and both architectures.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from atom.optim import lr_at
from atom.resident.engine import ResidentEngine
from atom.swap.backend import CpuBackend, Transfer
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config

STEPS = 5


def batches_for(step: int, cfg, vocab: int = 256):
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(cfg.train.grad_accum):
        # learnable sequences (each row counts up by a stride from a random start), so the
        # loss falls within a few steps
        start = torch.randint(0, vocab, (cfg.train.micro_batch, 1), generator=g)
        stride = torch.randint(1, 4, (cfg.train.micro_batch, 1), generator=g)
        x = (start + stride * torch.arange(cfg.model.seq_len + 1)) % vocab
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: relative to the tensor's scale, not per element (Adam turns
    1-ulp differences in near-zero gradients into larger relative ones element-wise)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def train_both(cfg, backend=None):
    swapped = SwapEngine(cfg, backend or CpuBackend(), torch.float32)
    resident = ResidentEngine(cfg, torch.device("cpu"), torch.float32)
    losses = []
    try:
        for step in range(STEPS):
            batches = batches_for(step, cfg)
            lr = lr_at(step, cfg.train)
            losses.append(
                (swapped.train_step(batches, lr).loss, resident.train_step(batches, lr).loss)
            )
        return swapped, resident, losses, swapped.named_parameters()
    finally:
        swapped.close()


CASES = [
    # arch, layers_per_unit, prefetch, grad_accum, checkpoint, grad_clip, order
    ("gpt", 1, 1, 1, True, 1.0, "unit"),
    ("gpt", 2, 2, 2, True, 1.0, "unit"),
    ("gpt", 2, 2, 2, True, 1.0, "micro"),
    ("gpt", 1, 0, 3, True, 0.0, "unit"),
    ("gpt", 1, 0, 3, True, 0.0, "micro"),
    ("gpt", 3, 1, 1, False, 1.0, "unit"),
    ("gpt", 1, 3, 2, False, 0.0, "unit"),
    ("gpt", 1, 3, 2, False, 0.0, "micro"),
    ("llama", 1, 1, 1, True, 1.0, "unit"),
    ("llama", 2, 0, 2, True, 0.0, "unit"),
    ("llama", 1, 2, 3, False, 1.0, "unit"),
    ("llama", 1, 2, 3, False, 1.0, "micro"),
    ("gpt", 2, 1, 2, "offload", 1.0, "unit"),  # checkpointed inputs kept in host memory
    ("gpt", 2, 1, 2, "offload", 1.0, "micro"),
]


@pytest.mark.parametrize("arch,lpu,prefetch,accum,ckpt,clip,order", CASES)
def test_swapped_matches_resident(arch, lpu, prefetch, accum, ckpt, clip, order):
    model = {"arch": arch}
    if arch == "llama":
        model["n_kv_head"] = 2  # exercise grouped-query attention
    swap = {
        "layers_per_unit": lpu,
        "prefetch": prefetch,
        "checkpoint": bool(ckpt),
        "offload_activations": ckpt == "offload",
        "order": order,
    }
    cfg = tiny_config(model=model, train={"grad_accum": accum, "grad_clip": clip}, swap=swap)
    swapped, resident, losses, params = train_both(cfg)
    for s, r in losses:
        assert abs(s - r) / abs(r) <= 1e-5, losses
    assert losses[-1][0] < losses[0][0]  # it trained
    ref = resident.named_parameters()
    assert set(params) == set(ref)
    for name, p in ref.items():
        assert rel_err(params[name], p) <= 1e-5, name
    # the resident bound: never more units on the device than slots, slots = prefetch + 1
    assert len(swapped.slots.slots) == prefetch + 1
    assert swapped.slots.max_resident <= prefetch + 1


class SlowCopyBackend(CpuBackend):
    """Copies that land late and in bursts: a slot reused before its copy finished, or a
    copy that overwrote a slot still being read, would change the numbers."""

    def __init__(self):
        super().__init__(helper_threads=True)  # copies on a thread of their own
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def h2d(self, dst, src, after, host_ready, locks=()):
        # counted when issued, uncounted when the copy has landed: copies still queued
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

        def slow_src_copy():
            time.sleep(0.002)
            for ev in host_ready:
                ev.wait()
            # copy in two halves with a pause: a reader racing the copy would see a mix
            half = src.numel() // 2
            dst[:half].copy_(src[:half])
            time.sleep(0.001)
            dst[half:].copy_(src[half:])
            with self._lock:
                self.in_flight -= 1

        return self._copier.submit(slow_src_copy, Transfer())


def test_slow_copies_change_nothing():
    cfg = tiny_config(train={"grad_accum": 2}, swap={"layers_per_unit": 1, "prefetch": 2})
    backend = SlowCopyBackend()
    swapped, resident, losses, params = train_both(cfg, backend)
    for s, r in losses:
        assert abs(s - r) / abs(r) <= 1e-5
    for name, p in resident.named_parameters().items():
        assert rel_err(params[name], p) <= 1e-5, name
    # prefetch really ran ahead: several copies were outstanding while compute went on
    assert backend.max_in_flight >= 2
    assert swapped.slots.max_resident == 3


@pytest.mark.parametrize("order", ["unit", "micro"])
def test_resident_bound_counted_at_every_load(order):
    cfg = tiny_config(
        model={"n_layer": 4},
        train={"grad_accum": 2},
        swap={"layers_per_unit": 1, "prefetch": 1, "order": order},
    )
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    counts = []
    original = engine.slots.load

    def counting_load(unit, src, ready, locks=()):
        slot = original(unit, src, ready, locks)
        counts.append(len(engine.slots.resident_units()))
        return slot

    engine.slots.load = counting_load
    try:
        engine.train_step(batches_for(0, cfg), 1e-3)
        engine.evaluate(batches_for(1, cfg))
    finally:
        engine.close()
    assert len(engine.units) == 6
    assert max(counts) == 2  # never more than prefetch + 1
    # Units needed again within the window stay resident instead of reloading.
    # unit-major: the forward loads 0..5 once for both micro-batches (6), the backward
    # reuses unit 4 (kept from the forward) and loads 3, 2, 1, 0 (4).
    # micro-major: micro 0 as above (6 + 4); unit 1 and 0 stay for micro 1, whose forward
    # loads 2..5 (4) and backward 3..0 (4, unit 4 kept again).
    # Evaluation is unit-major: 6 loads for both batches.
    train_loads = 6 + 4 if order == "unit" else 6 + 4 + 4 + 4
    assert len(counts) == train_loads + 6


@pytest.mark.parametrize("order", ["unit", "micro"])
@pytest.mark.parametrize("accum", [1, 3])
def test_gradients_cross_to_the_host_once_per_unit_per_step(order, accum):
    """Unit-major: one device-to-host gradient copy per unit per optimizer step, whatever
    grad_accum is (accumulated on the device); micro-major: one per unit per micro-batch."""
    cfg = tiny_config(train={"grad_accum": accum}, swap={"order": order, "prefetch": 1})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        for step in range(2):
            before = engine.d2h_copies
            engine.train_step(batches_for(step, cfg), 1e-3)
            per_step = engine.d2h_copies - before
            n_units = len(engine.units)
            assert per_step == (n_units if order == "unit" else n_units * accum)
    finally:
        engine.close()


def test_evaluate_matches_resident():
    cfg = tiny_config(model={"arch": "llama"})
    swapped = SwapEngine(cfg, CpuBackend(), torch.float32)
    resident = ResidentEngine(cfg, torch.device("cpu"), torch.float32)
    try:
        batches = batches_for(0, cfg)
        assert abs(swapped.evaluate(batches) - resident.evaluate(batches)) < 1e-5
    finally:
        swapped.close()


def test_bf16_on_cpu_trains_close_to_fp32():
    """The compute-dtype copy path (separate bf16 buffers + fp32 master) on CPU."""
    cfg = tiny_config(train={"dtype": "bf16"})
    engine = SwapEngine(cfg, CpuBackend(), torch.bfloat16)
    resident = ResidentEngine(cfg, torch.device("cpu"), torch.float32)
    try:
        for step in range(STEPS):
            lr = lr_at(step, cfg.train)
            a = engine.train_step(batches_for(step, cfg), lr).loss
            b = resident.train_step(batches_for(step, cfg), lr).loss
            assert abs(a - b) / b < 2e-2
        assert engine.store.buffers[1].compute.dtype == torch.bfloat16
        assert engine.store.buffers[1].master.dtype == torch.float32
    finally:
        engine.close()


@pytest.mark.slow
def test_deepspeed_cpu_adam_matches_torch_adamw():
    """train.optimizer=deepspeed (DeepSpeedCPUAdam, JIT-built on first use: ~30 s once)."""
    pytest.importorskip("deepspeed")
    cfg = tiny_config(train={"optimizer": "deepspeed"})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    reference = ResidentEngine(tiny_config(), torch.device("cpu"), torch.float32)
    try:
        for step in range(STEPS):
            lr = lr_at(step, cfg.train)
            a = engine.train_step(batches_for(step, cfg), lr).loss
            b = reference.train_step(batches_for(step, cfg), lr).loss
            assert abs(a - b) / b < 1e-4
        ref = reference.named_parameters()
        params = engine.named_parameters()
        for name, p in ref.items():
            assert rel_err(params[name], p) < 1e-4, name
        assert type(engine.optimizers[0].opt).__name__ == "DeepSpeedCPUAdam"
    finally:
        engine.close()


def test_fp16_loss_scaling_skips_overflow_and_backs_off():
    """The fp16 path (GPUs without bf16) run through the CPU backend: an overflowing step
    is skipped without touching the weights and the loss scale halves."""
    cfg = tiny_config()
    engine = SwapEngine(cfg, CpuBackend(), torch.float16)
    try:
        first = engine.train_step(batches_for(0, cfg), 1e-3)
        assert not first.skipped and engine.scaler.scale == 2.0**16
        before = {k: v.clone() for k, v in engine.named_parameters().items()}
        engine.scaler.scale = 1e30  # scaled grads overflow fp16
        result = engine.train_step(batches_for(1, cfg), 1e-3)
        assert result.skipped and engine.scaler.scale == 5e29
        after = engine.named_parameters()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.scaler.scale = 2.0**10
        assert not engine.train_step(batches_for(2, cfg), 1e-3).skipped
        changed = engine.named_parameters()
        assert not torch.equal(
            changed["blocks.0.attn.c_attn.weight"], before["blocks.0.attn.c_attn.weight"]
        )
    finally:
        engine.close()


class _FailingD2H(CpuBackend):
    """Raises on the n-th gradient hand-off: an error in the middle of a backward."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def d2h(self, t, after=None, abort=None, dtype=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return super().d2h(t, after, abort, dtype)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_a_step_that_raises_leaves_the_engine_usable(clip):
    """An error after the head's gradient was handed off (its unit now waits for an
    update) must not leave units blocked: with deferred updates (clipping) the failed
    step changes nothing, and the run continues exactly like one that never failed."""
    cfg = tiny_config(train={"grad_clip": clip, "grad_accum": 2})
    posts_per_step = cfg.model.n_layer + 2  # head + blocks + embed, once per step (unit-major)
    failing = SwapEngine(cfg, _FailingD2H(fail_at=posts_per_step + posts_per_step - 2),
                         torch.float32)  # fmt: skip
    clean = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        failing.train_step(batches_for(0, cfg), 1e-3)
        with pytest.raises(RuntimeError, match="injected"):
            failing.train_step(batches_for(1, cfg), 1e-3)  # fails in the last backward
        failing.store.wait_all_ready(timeout=10)  # nothing left waiting for an update
        assert failing.slots.max_resident <= cfg.swap.prefetch + 1
        losses = [failing.train_step(batches_for(s, cfg), 1e-3).loss for s in (1, 2)]
        ref = [clean.train_step(batches_for(s, cfg), 1e-3).loss for s in (0, 1, 2)][1:]
        if clip > 0:  # deferred updates: the failed step applied nothing
            assert losses == pytest.approx(ref, rel=1e-6)
            got, want = failing.named_parameters(), clean.named_parameters()
            assert max(rel_err(got[n], want[n]) for n in want) < 1e-6
        else:  # units whose gradients were final before the error were updated
            assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        failing.close()
        clean.close()


def _train(cfg, steps: int = STEPS):
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        losses = [
            engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in range(steps)
        ]
        return losses, engine.named_parameters(), engine
    finally:
        engine.close()


@pytest.mark.parametrize("order,accum", [("unit", 1), ("unit", 3), ("micro", 2)])
def test_eager_update_equals_exact_when_no_step_is_clipped(order, accum):
    """swap.update=eager's contract: each unit updates as soon as its gradients land,
    clipped by the previous step's norm, so with a clip no step reaches it equals exact."""
    swap = {"order": order, "prefetch": 1}
    train = {"grad_accum": accum, "grad_clip": 1e6}
    exact_losses, exact, _ = _train(tiny_config(train=train, swap=swap))
    eager_losses, eager, engine = _train(tiny_config(train=train, swap={**swap, "update": "eager"}))
    assert engine.eager and not engine.deferred
    assert eager_losses == pytest.approx(exact_losses, rel=1e-6)
    assert max(rel_err(eager[n], exact[n]) for n in exact) <= 1e-6


def test_eager_update_clips_by_the_previous_steps_norm():
    """With clipping active the eager run uses step s-1's norm for step s: it differs from
    exact training, trains, and reports the previous step's norm."""
    cfg = tiny_config(train={"grad_clip": 0.05}, swap={"update": "eager"})
    exact_cfg = tiny_config(train={"grad_clip": 0.05})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    exact = SwapEngine(exact_cfg, CpuBackend(), torch.float32)
    try:
        results = [engine.train_step(batches_for(s, cfg), 1e-3) for s in range(STEPS)]
        norms = [exact.train_step(batches_for(s, cfg), 1e-3).grad_norm for s in range(STEPS)]
        assert results[0].grad_norm is None  # no step had finished yet
        assert results[1].grad_norm == pytest.approx(norms[0], rel=1e-5)  # same first step
        assert results[-1].loss < results[0].loss
        got, want = engine.named_parameters(), exact.named_parameters()
        assert max(rel_err(got[n], want[n]) for n in want) > 1e-4  # clipped differently
    finally:
        engine.close()
        exact.close()


def test_eager_update_never_applies_a_non_finite_gradient():
    cfg = tiny_config(swap={"update": "eager"})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        engine.train_step(batches_for(0, cfg), 1e-3)
        before = {k: v.clone() for k, v in engine.named_parameters().items()}
        head = engine.units[-1]
        original = engine._head_step

        def poisoned(*args):
            loss, grad_h, grads = original(*args)
            grads[0] = torch.full_like(grads[0], float("nan"))
            return loss, grad_h, grads

        engine._head_step = poisoned
        engine.train_step(batches_for(1, cfg), 1e-3)
        after = engine.named_parameters()
        assert engine.skipped_units >= 1
        assert all(torch.isfinite(v).all() for v in after.values())
        owned = {p.full_name for p in head.owned}
        assert all(torch.equal(before[n], after[n]) for n in owned)
    finally:
        engine.close()


@pytest.mark.parametrize("order", ["micro", "unit"])
def test_resident_units_stay_for_the_step_and_change_nothing(order):
    """swap.resident_units keeps the block units nearest the head on the device for the
    whole step: micro-batch-major then loads them once per step instead of per micro-batch,
    the numbers stay those of plain PyTorch, and the bound is prefetch + 1 + resident."""
    swap = {"layers_per_unit": 1, "prefetch": 1, "order": order}
    cfg = tiny_config(model={"n_layer": 4}, train={"grad_accum": 3}, swap=swap)
    pinned_cfg = tiny_config(
        model={"n_layer": 4}, train={"grad_accum": 3}, swap={**swap, "resident_units": 2}
    )
    plain = SwapEngine(cfg, CpuBackend(), torch.float32)
    swapped, resident, losses, params = train_both(pinned_cfg)
    try:
        for s, r in losses:
            assert abs(s - r) / abs(r) <= 1e-5
        for name, p in resident.named_parameters().items():
            assert rel_err(params[name], p) <= 1e-5, name
        assert swapped.resident_units == {3, 4}  # the two block units before the head
        assert len(swapped.slots.slots) == 1 + 1 + 2
        assert swapped.slots.max_resident <= 1 + 1 + 2
        for step in range(STEPS):
            plain.train_step(batches_for(step, cfg), 1e-3)
        if order == "micro":  # 2 units x (2 loads per micro-batch - 1 per step) x 3 x steps
            assert swapped.slots.loads < plain.slots.loads
        else:
            assert swapped.slots.loads <= plain.slots.loads
    finally:
        plain.close()


def test_bf16_orders_sum_the_same_gradients():
    """bf16 compute with grad_accum: unit-major sums the micro-batches' bf16 gradients in
    fp32 on the device; micro-batch-major lands each in the fp32 host gradient (converted
    first, then added). Same values, same order: the same weights, bit for bit."""
    results = {}
    for order in ("unit", "micro"):
        cfg = tiny_config(train={"dtype": "bf16", "grad_accum": 3}, swap={"order": order})
        engine = SwapEngine(cfg, CpuBackend(), torch.bfloat16)
        try:
            for step in range(3):
                engine.train_step(batches_for(step, cfg), 1e-3)
            results[order] = engine.named_parameters()
        finally:
            engine.close()
    for name, p in results["unit"].items():
        assert torch.equal(p, results["micro"][name]), name


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_stop_abandons_a_step_only_before_its_first_update(clip):
    """Ctrl+C inside a long step (`stop`): with clipping (updates wait for the step's end)
    the step is abandoned and the weights are untouched; without it, units update as
    their gradients land, so once one has, the step runs to its end (a checkpoint of the
    step before must not hold some units of this one)."""
    cfg = tiny_config(train={"grad_clip": clip})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        engine.train_step(batches_for(0, cfg), 1e-3)
        before = {n: p.clone() for n, p in engine.named_parameters().items()}
        n_forward = len(engine.units)
        asked = [0]

        def stop() -> bool:  # Ctrl+C arrives in the backward, after the head's gradient
            asked[0] += 1
            return asked[0] > n_forward

        if clip:
            with pytest.raises(KeyboardInterrupt):
                engine.train_step(batches_for(1, cfg), 1e-3, stop=stop)
            after = engine.named_parameters()
            assert all(torch.equal(after[n], p) for n, p in before.items())
        else:
            assert engine.train_step(batches_for(1, cfg), 1e-3, stop=stop).loss > 0
        engine.train_step(batches_for(2, cfg), 1e-3)  # usable either way
    finally:
        engine.close()


def test_sliding_window_attention_trains_swapped_as_resident():
    """A llama with an 8-token window on 32-token sequences: swapped (with recompute)
    equals plain PyTorch, so the band mask survives units, checkpoints and recompute."""
    cfg = tiny_config(model={"arch": "llama", "sliding_window": 8}, swap={"checkpoint": True})
    swapped, resident, losses, params = train_both(cfg)
    for a, b in losses:
        assert abs(a - b) <= 1e-5 * abs(b)
    for name, p in resident.named_parameters().items():
        assert rel_err(params[name], p) < 1e-5, name


@pytest.mark.parametrize("cut", ["synchronize", "drain"])
def test_a_second_ctrl_c_while_a_step_is_abandoned_leaves_no_unit_blocked(monkeypatch, cut):
    """The first Ctrl+C abandons a step whose units wait for the step's end (clipping);
    a second one lands in the abandon path's own waits (the device, the host worker):
    it goes up once the cleaning is done, and nothing waits for updates never submitted
    (it did: the save after it waited 10 minutes for the first such unit)."""
    cfg = tiny_config(train={"grad_clip": 1.0})
    engine = SwapEngine(cfg, CpuBackend(helper_threads=True), torch.float32)
    try:
        engine.train_step(batches_for(0, cfg), 1e-3)
        before = {n: p.clone() for n, p in engine.named_parameters().items()}
        asked = [0]

        def stop() -> bool:  # in the backward, after some units' gradients were posted
            asked[0] += 1
            return asked[0] > len(engine.units) + 2

        target = engine.backend if cut == "synchronize" else engine.worker
        real = getattr(target, cut)
        calls = [0]

        def second_ctrl_c(*a, **kw):
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt
            return real(*a, **kw)

        monkeypatch.setattr(target, cut, second_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            engine.train_step(batches_for(1, cfg), 1e-3, stop=stop)
        assert calls[0] >= 1
        engine.store.wait_all_ready(timeout=10)  # raised after 10 s where a unit was blocked
        after = engine.named_parameters()
        assert all(torch.equal(after[n], p) for n, p in before.items())
        assert engine.train_step(batches_for(2, cfg), 1e-3).loss > 0
    finally:
        engine.close()
