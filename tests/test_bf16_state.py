"""bf16 state (swap.state: bf16, atom/optim/bf16.py): bf16 weights as the master, 8-bit
moments, updates rounded to bf16 stochastically with random integers hashed from (seed,
unit, step, element).

    pytest tests/test_bf16_state.py

The rounding is unbiased and keeps bf16 values; updates under half an ulp move a weight
on average (round-to-nearest never does); one unit's update equals plain PyTorch (AdamW in
fp32 on the bf16 weight's value, the moments through compact's 8-bit codec, the same
rounding written out) bit for bit; the card update equals the host update bit for bit on
the CPU backend; a resume is bit-exact; the NVMe tier equals RAM; other states'
checkpoints load rounded to the nearest bf16.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from atom.cli import main
from atom.config import ConfigError, TrainConfig
from atom.optim import lr_at
from atom.optim.bf16 import (
    Bf16AdamW,
    Bf16Scratch,
    mix32,
    random_bits,
    round_stochastic,
    stream_key,
)
from atom.optim.chunk_update import bf16_chunk
from atom.optim.compact import CHUNK, decode, encode, padded
from atom.optim.state import ADAM_EPS
from atom.run.train import Trainer
from atom.store.checkpoint import load_checkpoint, save_checkpoint
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_card_update import _config, _flat, _train
from tests.test_swap_equivalence import batches_for
from tests.test_train_resume import final_params, losses


def _round(x: torch.Tensor, key: int = 12345, start: int = 0) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    ints = [torch.empty(x.numel(), dtype=torch.int64) for _ in range(2)]
    round_stochastic(x, out, key, start, ints)
    return out


def _round_plainly(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The rounding as written out: add r to the fp32 bits, keep the upper half."""
    bits = x.view(torch.int32).long() + torch.where(torch.isnan(x), 0, r)
    return (bits >> 16).to(torch.int16).view(torch.bfloat16)


def test_the_hash_is_the_same_per_element_as_in_python():
    key = stream_key(1337, 3, 7)
    got = random_bits(key, 1000, 64).tolist()
    assert got == [mix32(i ^ key) >> 16 for i in range(1000, 1064)]
    assert stream_key(1337, 3, 8) != key and stream_key(1337, 4, 7) != key
    r = random_bits(key, 0, 1 << 18)
    assert r.min() >= 0 and r.max() < 1 << 16
    # uniform: each of 16 bins of the range holds 1/16 of them (within 4%: a bin's
    # standard deviation is 0.8% of it)
    counts = torch.bincount(r >> 12, minlength=16).float() / r.numel()
    assert (counts * 16 - 1).abs().max() < 0.04


@pytest.mark.parametrize("value", [1.0 + 2**-9, 1.0 + 3 * 2**-9, -3.0 - 2**-8, 1e-3, 1e-30])
def test_stochastic_rounding_is_unbiased(value):
    """Between two bf16s, a value rounds to one of them, up with the probability of its
    distance: the mean of many roundings is the value (each element has its own draw)."""
    n = 1 << 16
    x = torch.full((n,), value)
    got = _round(x).float()
    lo = torch.tensor([value]).to(torch.bfloat16).float().item()  # a neighbour
    neighbours = set(got.unique().tolist())
    assert len(neighbours) == 2 and lo in neighbours
    ulp = abs(max(neighbours) - min(neighbours))
    # a Bernoulli mean over 2^16 draws: its standard deviation is at most ulp/512
    assert abs(got.double().mean().item() - value) < 5 * ulp / 512


def test_bf16_values_and_non_finite_ones_round_to_themselves():
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    every = bits.view(torch.bfloat16)  # every bf16, subnormals, zeros, infs and NaNs
    got = _round(every.float())
    finite = torch.isfinite(every)
    assert torch.equal(got[finite].view(torch.int16), bits[finite])
    assert torch.equal(torch.isnan(got), torch.isnan(every))
    assert torch.equal(torch.isinf(got), torch.isinf(every))
    # a NaN anywhere takes the masked path: the other elements' bits are the fast path's
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    with_nan = x.clone()
    with_nan[1234] = math.nan
    fast, masked = _round(x), _round(with_nan)
    assert torch.isnan(masked[1234]) and not torch.isnan(fast).any()
    keep = torch.arange(5000) != 1234
    assert torch.equal(fast[keep].view(torch.int16), masked[keep].view(torch.int16))
    plain = _round_plainly(x, random_bits(12345, 0, 5000))
    assert torch.equal(fast.view(torch.int16), plain.view(torch.int16))
    # NaN of any payload stays NaN, one with its payload all in the low half included
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, -0x7FFFFF], dtype=torch.int32)
    assert torch.isnan(_round(nans.view(torch.float32))).all()
    # beyond bf16's largest finite value, up to inf at times (as torchao's rounding)
    big = _round(torch.full((4096,), 3.39e38))
    assert set(big.float().unique().tolist()) <= {torch.finfo(torch.bfloat16).max, math.inf}


def _cfg(**kw) -> TrainConfig:
    return replace(TrainConfig(), beta1=0.9, beta2=0.99, weight_decay=0.1, **kw)


def test_updates_under_half_an_ulp_move_a_weight_on_average():
    """Weights of 1.0, a steady gradient: each step moves them by about lr, a tenth of a
    bf16 ulp there. Round-to-nearest would keep 1.0 forever; stochastic rounding moves
    the mean by the sum of the steps."""
    n, steps, lr = 4096, 200, 0.1 * 2**-7
    assert torch.tensor(1.0 - lr).to(torch.bfloat16).item() == 1.0  # nearest: no move
    master = torch.ones(n, dtype=torch.bfloat16)
    grad = torch.ones(n, dtype=torch.bfloat16)
    opt = Bf16AdamW(master, grad, n, 0, 0, _cfg(), Bf16Scratch(n))
    for _ in range(steps):
        opt.step(lr)
    moved = 1.0 - master.float().mean().item()
    assert 0.9 * steps * lr < moved < 1.1 * steps * lr


def _reference_step(p, g, m, s, lr, coef, t, cfg, n_decay, key):
    """One step in plain PyTorch: AdamW in fp32 on the bf16 weights' values, the moments
    through the 8-bit codec, the rounding written out."""
    n = p.numel()
    g = torch.cat([g.float() * coef, torch.zeros(padded(n) - n)])
    m = torch.lerp(m, g, 1 - cfg.beta1)
    s = torch.sqrt(torch.addcmul(s * s * cfg.beta2, g, g, value=1 - cfg.beta2))
    bc1, rbc2 = 1 - cfg.beta1**t, 1 / math.sqrt(1 - cfg.beta2**t)
    step = m / (s * rbc2 + ADAM_EPS) * (-lr / bc1)
    w = p.float()
    step[:n_decay] += w[:n_decay] * (-lr * cfg.weight_decay)
    new = _round_plainly(w + step[:n], random_bits(key, 0, n))
    return new, _codec(m), _codec(s)


def _codec(x):
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(x.numel() // 256)
    encode(x.clone(), codes, scales)
    return decode(codes, scales, torch.empty_like(x))


def test_a_units_update_equals_plain_pytorch_bit_for_bit():
    """Two chunks and a bit, the decay boundary inside the first, the gradient clipped."""
    n, n_decay, unit = CHUNK + 1000, 5000, 3
    cfg = _cfg()
    gen = torch.Generator().manual_seed(0)
    master = (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16)
    grad = torch.empty(n, dtype=torch.bfloat16)
    opt = Bf16AdamW(master, grad, n, n_decay, unit, cfg, Bf16Scratch(n))
    start = master.clone()
    p, m, s = master.clone(), torch.zeros(padded(n)), torch.zeros(padded(n))
    for t, (lr, coef) in enumerate([(1e-3, 1.0), (3e-3, 0.5), (2e-4, 1.0)], start=1):
        grad.copy_(torch.randn(n, generator=gen) * 1e-2)
        opt.step(lr, coef)
        key = stream_key(cfg.seed, unit, t)
        p, m, s = _reference_step(p, grad, m, s, lr, coef, t, cfg, n_decay, key)
        assert torch.equal(master.view(torch.int16), p.view(torch.int16)), t
        assert torch.equal(decode(opt.m_codes, opt.m_scales, torch.empty(padded(n))), m)
        assert torch.equal(decode(opt.s_codes, opt.s_scales, torch.empty(padded(n))), s)
    assert (master.float() - start.float()).abs().max() > 0 and opt.steps == 3


BF16 = {"swap": {"state": "bf16"}}

# (grad_clip, swap.update, order, grad_accum, resident_units): the card keeps its gradient
# in fp32 and rounds it to bf16 as the host's landing does. Left out: micro-batch-major
# accumulation (the host sums in bf16) and clipping (the global norm is taken over the
# card's fp32 gradient and the host's bf16 one); the chunk test below clips
CASES = [(0.0, "exact", "unit", 1, 0), (0.0, "exact", "unit", 2, 1), (0.0, "eager", "unit", 2, 0)]


@pytest.mark.parametrize("clip,update,order,accum,resident", CASES)
def test_card_update_equals_host_update_bit_for_bit(clip, update, order, accum, resident):
    host = _train(_config("none", clip, update, order, accum, resident, **BF16))
    card = _train(_config("all", clip, update, order, accum, resident, **BF16))
    assert card[2] == 4 * 5 and host[2] == 0
    assert card[0] == host[0]
    want, got = _flat(host[1]), _flat(card[1])
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_a_device_chunk_equals_the_host_update_clipped():
    """bf16_chunk (the card update's arithmetic) on an fp32 gradient that is bf16 already,
    in two device chunks of another size than the host's: the host's bits."""
    n, n_decay, unit, cfg = 3000, 700, 2, _cfg()
    gen = torch.Generator().manual_seed(1)
    w0 = (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    host = Bf16AdamW(w0.clone(), grad, n, n_decay, unit, cfg, Bf16Scratch(n))
    card = Bf16AdamW(w0.clone(), torch.empty(0), n, n_decay, unit, cfg, Bf16Scratch(n))
    for lr, coef in [(1e-3, 0.3), (2e-3, 1.0)]:
        host.step(lr, coef)
        numbers, betas, key = card.begin_step(lr)
        for start, end in [(0, 2048), (2048, n)]:
            decayed = max(0, min(end - start, n_decay - start))
            bf16_chunk(grad[start:end].float(), card.master[start:end], card.codes(start, end),
                       coef, numbers, betas, decayed, key, start, Bf16Scratch(n))  # fmt: skip
        assert torch.equal(card.master.view(torch.int16), host.master.view(torch.int16))
        for a, b in [(card.m_codes, host.m_codes), (card.s_scales, host.s_scales)]:
            assert torch.equal(a, b)


def test_it_trains_as_fp32_state_does_and_its_weights_are_bf16():
    cfg = tiny_config(swap={"state": "bf16"}, model={"tie_embeddings": False})
    fp32 = _train(replace(cfg, swap=replace(cfg.swap, state="fp32")), steps=8)[0]
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        run = [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in range(8)]
        assert run[-1] < run[0] - 0.1
        assert abs(run[-1] - fp32[-1]) < 0.02 * fp32[-1], (run, fp32)
        n = sum(b.spec.n_owned for b in engine.store.buffers)
        assert all(b.master.dtype == torch.bfloat16 and b.rem is None for b in engine.store.buffers)
        # weights 2 + gradient 2 (bf16) + the fp32 compute copy on this fp32 CPU run: 8
        assert engine.store.nbytes() == 8 * n
        for p in engine.named_parameters().values():
            assert p.dtype == torch.float32 and torch.equal(p, p.bfloat16().float())
    finally:
        engine.close()


def test_a_resume_is_bit_exact(tmp_path, text_dataset):
    cfg = tiny_config(
        train={"max_steps": 8, "grad_accum": 2, "data": str(text_dataset)},
        swap={"layers_per_unit": 1, "prefetch": 1, "state": "bf16"},
    )
    Trainer(cfg, tmp_path / "full", progress=False).run()
    Trainer(cfg, tmp_path / "split", progress=False).run(max_steps=3)
    Trainer(cfg, tmp_path / "split", resume=tmp_path / "split", progress=False).run()
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    full, split = final_params(tmp_path / "full"), final_params(tmp_path / "split")
    assert full.keys() == split.keys()
    for name in full:
        assert torch.equal(full[name], split[name]), name


@pytest.mark.parametrize("source", ["fp32", "compact"])
def test_other_states_checkpoints_load_rounded_to_nearest(tmp_path, source):
    a = SwapEngine(tiny_config(swap={"state": source}), CpuBackend(), torch.float32)
    cfg = tiny_config(swap={"state": "bf16"})
    try:
        for s in range(2):
            a.train_step(batches_for(s, cfg), lr_at(s, cfg.train))
        path = save_checkpoint(tmp_path / "run", 2, a.state_files(), {"optimizer_steps": 2})
        want = a.named_parameters()
    finally:
        a.close()
    b = SwapEngine(cfg, CpuBackend(), torch.float32, init=False)
    try:
        b.load_state(load_checkpoint(path).get, True, 2)
        got = b.named_parameters()
        for name, p in want.items():
            assert torch.equal(got[name], p.bfloat16().float()), name
        b.train_step(batches_for(2, cfg), lr_at(2, cfg.train))  # and it trains on
    finally:
        b.close()


def test_the_nvme_tier_equals_ram(tmp_path):
    def run(cfg):
        engine = SwapEngine(cfg, CpuBackend(), torch.float32)
        try:
            out = [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                   for s in range(4)]  # fmt: skip
            return out, engine.named_parameters()
        finally:
            engine.close()

    ram = run(tiny_config(swap={"state": "bf16"}))
    disk = run(tiny_config(swap={"state": "bf16", "disk_dir": str(tmp_path)}))
    assert disk[0] == ram[0]
    for name, p in ram[1].items():
        assert torch.equal(disk[1][name], p), name


def test_atom_train_with_bf16_state_through_the_cli(tmp_path, text_dataset, capsys):
    argv = ["train", "--set", f"train.data={text_dataset}", "--set", "model.n_layer=2",
            "--set", "swap.state=bf16", "--max-steps", "3", "--out", str(tmp_path / "run"),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "bf16 state" in capsys.readouterr().out


def test_deepspeed_with_bf16_state_is_refused_in_one_line():
    with pytest.raises((ConfigError, ValueError), match="swap.state=bf16 runs its own"):
        tiny_config(swap={"state": "bf16"}, train={"optimizer": "deepspeed"})


@pytest.mark.parametrize("tier", [False, True], ids=["ram", "nvme"])
@pytest.mark.parametrize("resident", [0, 3], ids=["streamed", "kept"])
def test_the_card_update_on_the_cuda_backend_orders_every_copy(
    monkeypatch, tmp_path, tier, resident
):
    """The fake CUDA (tests/fake_cuda.py) over the bf16 path: every copy waited for, and
    the bits of the CPU backend's run; kept on the card, the weights come from the slot."""
    from tests.test_card_update import test_card_update_on_the_cuda_backend_orders_every_copy

    case = ("bf16", 1.0, "eager", resident, torch.bfloat16)
    test_card_update_on_the_cuda_backend_orders_every_copy(monkeypatch, tmp_path, case, tier)
