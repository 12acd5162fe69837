"""Compact host state (swap.state: compact): the 8-bit moment codec, the AdamW on the
bf16 + remainder master against torch's fp32 AdamW, checkpoints in the fp32 format, and the engine.

    pytest tests/test_compact_adamw.py
"""

from __future__ import annotations

import math

import pytest
import torch

from atom.config import ConfigError, TrainConfig
from atom.optim import lr_at
from atom.optim.compact import BLOCK, ChunkScratch, CompactAdamW, decode, encode, padded
from atom.optim.remainder import join, split
from atom.resident.engine import ResidentEngine
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_swap_equivalence import batches_for, rel_err


@pytest.mark.parametrize("flush", [True, False])
def test_decode_matches_torch_float8_for_every_code(flush):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(BLOCK // 256 or 1)
    reference = codes.view(torch.float8_e4m3fn).float()
    finite = ~reference.isnan()  # 0x7f and 0xff are e4m3fn's NaNs; encode never makes them
    before = (
        torch.is_flush_denormal_enabled() if hasattr(torch, "is_flush_denormal_enabled") else True
    )
    torch.set_flush_denormal(flush)
    try:
        out = decode(codes, torch.ones(1), torch.empty(256))
    finally:
        torch.set_flush_denormal(before)
    assert torch.equal(out[finite], reference[finite])
    assert reference[1] == 2.0**-9  # the smallest subnormal is among the codes checked


def test_encode_keeps_each_block_in_range_and_zero_blocks_zero():
    g = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes; one block all zero
    x = torch.randn(4 * BLOCK, generator=g) * torch.tensor([1e-8, 1.0, 1e6, 0.0]).repeat_interleave(
        BLOCK
    )
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(4)
    encode(x, codes, scales)
    y = decode(codes, scales, torch.empty_like(x))
    assert torch.equal(y[3 * BLOCK :], torch.zeros(BLOCK))
    for b in range(3):
        xb, yb = x[b * BLOCK : (b + 1) * BLOCK], y[b * BLOCK : (b + 1) * BLOCK]
        big = xb.abs() > xb.abs().max() * 2**-6  # e4m3's normal range below the block max
        # three mantissa bits: round to nearest is within 1/16 relative
        assert ((yb - xb).abs()[big] <= xb.abs()[big] / 16 + 1e-30).all()
        assert (yb.abs() <= xb.abs().max() * (1 + 1e-6)).all()
        assert torch.equal(torch.sign(yb[yb != 0]), torch.sign(xb[yb != 0]))


def _compact(n: int, n_decay: int, cfg: TrainConfig, init: torch.Tensor):
    master, rem = split(init.clone())
    grad = torch.zeros(n, dtype=torch.bfloat16)
    opt = CompactAdamW(master, rem, grad, n, n_decay, cfg, ChunkScratch(n))
    return opt, master, rem, grad


def test_compact_adamw_follows_torch_adamw():
    """Same gradients into torch's fp32 AdamW and the compact one: the trajectories agree
    to a few percent of the distance travelled. Pure-noise gradients are the worst case
    for 8-bit moments (m hovers around zero): measured 5% (L2) over seeds, each moment's
    rounding about half of it; with both moments kept exact the two agree to 1e-4, so
    this is the codec's error and the formula is torch's."""
    cfg = TrainConfig(weight_decay=0.1, beta1=0.9, beta2=0.99)
    n, n_decay = 3 * BLOCK + 17, 2 * BLOCK + 5  # a partial block, decay split mid-block
    g = torch.Generator().manual_seed(1)
    init = torch.randn(n, generator=g) * 0.02
    ref = init.clone().requires_grad_()
    torch_opt = torch.optim.AdamW(
        [{"params": [ref], "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99), eps=1e-8
    )
    opt, master, rem, grad = _compact(n, n_decay, cfg, init)
    scale = torch.exp(torch.randn(n, generator=g))  # per-element gradient scales
    for _ in range(30):
        lr = 1e-3
        gr = (torch.randn(n, generator=g) * scale * 1e-2).bfloat16().float()
        with torch.no_grad():  # decoupled decay on the decayed part, as the engine's groups
            ref[:n_decay].mul_(1 - lr * cfg.weight_decay)
        ref.grad = gr.clone()
        torch_opt.step()
        grad.copy_(gr)
        opt.step(lr)
    got = join(master, rem)
    moved, want = got - init, ref.detach() - init
    assert float((moved - want).norm() / want.norm()) < 0.08
    assert opt.steps == 30


def test_remainder_keeps_updates_smaller_than_half_a_bf16_ulp():
    """lr 1e-4 on weights of 1.0 (bf16 ulp 2^-7): each update is lost by plain bf16
    rounding (master would stay at 1.0, 0.02 off). A constant gradient makes every moment
    exact in 8 bits, so the master (bf16 + remainder) follows fp32 AdamW to fp32's own
    rounding (a bf16 Kahan compensation was ~3e-5 off here), and the bf16 weight moves."""
    cfg = TrainConfig(weight_decay=0.0)
    n = BLOCK
    opt, master, rem, grad = _compact(n, 0, cfg, torch.ones(n))
    grad.fill_(1.0)
    for _ in range(200):
        opt.step(1e-4)  # Adam's step is ~lr for a constant gradient
    ref = torch.ones(n, requires_grad=True)
    torch_opt = torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0, eps=1e-8)
    for _ in range(200):
        ref.grad = torch.ones(n)
        torch_opt.step()
    value = join(master, rem)
    assert torch.allclose(value, ref.detach(), rtol=0, atol=2e-6)
    assert (master.float() < 1.0).all()


def test_clip_coefficient_scales_the_gradient():
    cfg = TrainConfig(weight_decay=0.0)
    init = torch.randn(BLOCK) * 0.02
    a, ma, ca, ga = _compact(BLOCK, 0, cfg, init)
    b, mb, cb, gb = _compact(BLOCK, 0, cfg, init)
    grads = torch.randn(BLOCK)
    ga.copy_(grads)
    gb.copy_(grads * 0.5)
    a.step(1e-3, coef=0.5)
    b.step(1e-3)
    assert torch.equal(ma, mb) and torch.equal(ca, cb)


def test_state_round_trips_through_the_fp32_checkpoint_format():
    cfg = TrainConfig()
    n = padded(1000) + 3
    opt, master, rem, grad = _compact(n, n, cfg, torch.randn(n) * 0.02)
    for _ in range(3):
        grad.copy_(torch.randn(n) * 1e-2)
        opt.step(1e-3)
    m, v = opt.state_flat("exp_avg"), opt.state_flat("exp_avg_sq")
    assert m.dtype == v.dtype == torch.float32 and m.numel() == v.numel() == n
    assert (v >= 0).all()
    other, *_ = _compact(n, n, cfg, torch.zeros(n))
    other.load_state_flat("exp_avg", m, 3)
    other.load_state_flat("exp_avg_sq", v, 3)
    assert other.steps == 3
    assert torch.equal(other.m_codes, opt.m_codes)
    # sqrt(v)^2 then sqrt again may move a code by one step: the values agree closely
    assert rel_err(other.state_flat("exp_avg_sq"), v) < 1e-2


def test_compact_and_deepspeed_optimizer_are_refused_together():
    with pytest.raises(ConfigError, match="swap.state=compact"):
        tiny_config(swap={"state": "compact"}, train={"optimizer": "deepspeed"})


# ---------------------------------------------------------------------- the engine


def _losses(engine, cfg, steps: int, start: int = 0) -> list[float]:
    return [
        engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
        for s in range(start, start + steps)
    ]


@pytest.mark.parametrize("accum,order", [(1, "unit"), (2, "unit"), (2, "micro")])
def test_compact_engine_trains_like_fp32(accum, order):
    """The swap engine with compact state learns what plain PyTorch (fp32) learns: losses
    within 1% over the run (measured: within 0.1%), and the loss falls."""
    cfg = tiny_config(
        swap={"state": "compact", "order": order},
        train={"grad_accum": accum, "lr": 3e-3, "max_steps": 30},
    )
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    ref = ResidentEngine(cfg, torch.device("cpu"), torch.float32)
    try:
        got, want = _losses(engine, cfg, 30), _losses(ref, cfg, 30)
    finally:
        engine.close()
    assert got[-1] < got[0] - 0.5
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) < 0.01 * b, (got, want)


def test_compact_host_bytes_per_parameter():
    """Master, remainder, gradient and moments: 8 bytes per parameter (plus block
    scales); the fp32 compute copy the CPU backend needs is the bus copy, counted apart."""
    cfg = tiny_config(swap={"state": "compact"}, model={"tie_embeddings": False})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        store = engine.store
        n = sum(b.spec.n_owned for b in store.buffers)
        state = sum(b.master.nbytes + b.rem.nbytes + b.grad.nbytes for b in store.buffers) + sum(
            o.nbytes() for o in engine.optimizers
        )
        assert state / n <= 8.1
        fp32 = SwapEngine(tiny_config(model={"tie_embeddings": False}), CpuBackend(), torch.float32)
        try:
            fp32_state = sum(b.master.nbytes + b.grad.nbytes for b in fp32.store.buffers)
            fp32_state += sum(
                t.nbytes
                for o in fp32.optimizers
                for k in ("exp_avg", "exp_avg_sq")
                for t in [o.state_flat(k)]
                if t is not None
            )
        finally:
            fp32.close()
    finally:
        engine.close()
    assert fp32_state == 8 * n  # before the first step: master and grad only


def _train_save_continue(cfg, tmp_path, steps: int, more: int):
    """Train `steps`, checkpoint, train `more`: (checkpoint path, the later losses)."""
    from atom.store.checkpoint import save_checkpoint

    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        _losses(engine, cfg, steps)
        path = save_checkpoint(tmp_path, steps, engine.state_files(), {"optimizer_steps": steps})
        return path, _losses(engine, cfg, more, start=steps)
    finally:
        engine.close()


def test_compact_checkpoint_resume_continues_the_run(tmp_path):
    """Save after 4 steps, load into a fresh compact engine, train on: the same losses as
    the run that never stopped (the exact master and the moments survive the fp32 format)."""
    from atom.store.checkpoint import load_checkpoint

    cfg = tiny_config(swap={"state": "compact"}, train={"lr": 3e-3})
    path, tail = _train_save_continue(cfg, tmp_path, 4, 4)
    b = SwapEngine(cfg, CpuBackend(), torch.float32, init=False)
    try:
        b.load_state(load_checkpoint(path).get, True, 4)
        resumed = _losses(b, cfg, 4, start=4)
    finally:
        b.close()
    for x, y in zip(resumed, tail, strict=True):
        assert math.isclose(x, y, rel_tol=1e-4), (resumed, tail)


def test_fp32_checkpoint_resumes_into_compact(tmp_path):
    """Checkpoints have one format: an fp32-state run's checkpoint loads into a compact
    engine (weights to bf16 + remainder, exactly; moments to 8 bits) and its loss carries on."""
    from atom.store.checkpoint import load_checkpoint

    path, tail = _train_save_continue(tiny_config(train={"lr": 3e-3}), tmp_path, 6, 3)
    compact = tiny_config(swap={"state": "compact"}, train={"lr": 3e-3})
    b = SwapEngine(compact, CpuBackend(), torch.float32, init=False)
    try:
        get = load_checkpoint(path).get
        b.load_state(get, True, 6)
        loaded = b.named_parameters()
        resumed = _losses(b, compact, 3, start=6)
    finally:
        b.close()
    for name, t in loaded.items():
        assert torch.equal(t, get(name)), name  # bf16 + remainder: the fp32 value exactly
    for x, y in zip(resumed, tail, strict=True):
        assert abs(x - y) < 0.02 * y


def test_peers_merge_into_compact_master_and_remainder():
    """Gossip's door into the engine (UnitParams) sees fp32 weights in compact state too:
    a snapshot is master joined with its remainder, and a merged delta smaller than a bf16
    ulp is kept as fp32 would keep it."""
    from atom.gossip.merge import UnitParams

    cfg = tiny_config(swap={"state": "compact"})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        params = UnitParams(engine.shared_units())
        unit = params.units[1]
        before = params.snapshot(unit)
        assert before.dtype == torch.float32
        delta = torch.full_like(before, 1e-5)  # far below bf16's resolution at 0.02
        params.add(unit, delta)
        after = params.snapshot(unit)
        assert torch.equal(after, before + delta)  # the fp32 sum, bit for bit
        buf = engine.store.buffers[unit]
        assert torch.equal(buf.compute[: buf.spec.n_owned], buf.master.float())  # bus copy
        params.load(unit, before)
        assert torch.equal(params.snapshot(unit), before)
    finally:
        engine.close()
