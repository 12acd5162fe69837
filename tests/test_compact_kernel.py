"""The compiled compact update (atom/compact_kernel.py, swap.compile_update) against the
eager CompactAdamW it stands in for, and its fallback where it does not compile.

    pytest tests/test_compact_kernel.py

Compiles once (~30 s on 2 cores the first time; Inductor caches it on disk).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from atom.config import TrainConfig
from atom.optim import compact_kernel
from atom.optim.compact import BLOCK, CHUNK, ChunkScratch, CompactAdamW
from atom.optim.compact_kernel import F8, CompiledChunkUpdate, encode_moments, moments_and_master
from atom.optim.remainder import join, split
from atom.optim.state import ADAM_EPS

# two whole chunks and a short one; the decay boundary inside the second chunk: chunk 0
# is compiled (decayed), chunk 1 is cut by the boundary (eager), chunk 2 is short (eager)
N = 2 * CHUNK + 3 * BLOCK + 17
N_DECAY = CHUNK + 5 * BLOCK


def _pair(cfg: TrainConfig, fused) -> tuple[CompactAdamW, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    init = torch.randn(N, generator=g) * 0.02
    master, rem = split(init)
    grad = torch.zeros(N, dtype=torch.bfloat16)
    opt = CompactAdamW(master, rem, grad, N, N_DECAY, cfg, ChunkScratch(N), False, fused)
    return opt, grad


def _run(fused, steps: int = 4, coef: float = 0.5):
    cfg = TrainConfig(weight_decay=0.1, beta1=0.9, beta2=0.95)
    opt, grad = _pair(cfg, fused)
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        # a gradient with a few very different block ranges, some blocks all zero
        x = torch.randn(N, generator=g) * 1e-3
        x[: 4 * BLOCK] *= 1e4
        x[8 * BLOCK : 9 * BLOCK] = 0
        grad.copy_(x)
        opt.step(1e-3 * (t + 1), coef)
    return opt


def test_compiled_chunks_follow_the_eager_update():
    """Whole decayed chunks run compiled; the rest eagerly. A moment's code is at most its
    float8 neighbour (an fp32 value one ulp apart rounds to the next code), so the weights
    (the fp32 master, bf16 + remainder) follow the eager trajectory to ~1% of the
    distance travelled (measured 1.3%; a flipped code of a tiny sqrt(v) moves that element's
    step by up to ~10%, both roundings equally valid); the chunks run eagerly are bit-equal."""
    fused = CompiledChunkUpdate(0.9, 0.95)
    mine, ref = _run(fused), _run(None)
    start = _pair(TrainConfig(), None)[0]
    assert fused.available and fused.compile_s is not None

    def tracked(opt):
        return join(opt.master, opt.rem)[:CHUNK]

    moved = tracked(ref) - tracked(start)
    assert moved.norm() > 0 and not torch.equal(tracked(mine), tracked(start))
    assert (tracked(mine) - tracked(ref)).norm() <= 0.03 * moved.norm()
    for name in ("master", "rem", "m_codes", "s_codes"):  # eager there
        assert torch.equal(getattr(mine, name)[CHUNK:], getattr(ref, name)[CHUNK:]), name
    # one step from the same state: the same values, summed in another order
    one, ref_one = _run(fused, steps=1), _run(None, steps=1)
    for name in ("m_codes", "s_codes"):
        mc, rc = getattr(one, name)[:CHUNK].int(), getattr(ref_one, name)[:CHUNK].int()
        assert (mc - rc).abs().max() <= 1, name
        assert (mc != rc).float().mean() < 0.01, name


def test_without_a_compiler_the_eager_update_runs_and_says_so_once(monkeypatch, caplog):
    def no_compiler(fn, **kw):
        def fail(*a):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return fail

    monkeypatch.setattr(compact_kernel.torch, "compile", no_compiler)
    fused = CompiledChunkUpdate(0.9, 0.95)
    with caplog.at_level(logging.WARNING, logger="atom.optim.compact_kernel"):
        mine = _run(fused)
    ref = _run(None)
    assert not fused.available
    assert caplog.text.count("does not compile here") == 1
    assert "swap.compile_update=false" in caplog.text
    for name in ("master", "rem", "m_codes", "s_codes", "m_scales", "s_scales"):
        assert torch.equal(getattr(mine, name), getattr(ref, name)), name


def test_a_compile_that_fails_in_the_second_half_leaves_no_chunk_half_updated(monkeypatch):
    """The moments-and-master half compiles and would write the master; the encoding half
    then fails to compile. The first compiles run on copies, so the chunk is updated once,
    eagerly, exactly as without a compiler."""

    def encode_fails(fn, **kw):
        if fn is compact_kernel.encode_moments:

            def fail(*a):
                raise RuntimeError("CppCompileError: C++ compile error")

            return fail
        return fn  # the first half "compiles" (runs as written) and writes

    monkeypatch.setattr(compact_kernel.torch, "compile", encode_fails)
    fused = CompiledChunkUpdate(0.9, 0.95)
    mine = _run(fused)
    ref = _run(None)
    assert not fused.available
    for name in ("master", "rem", "m_codes", "s_codes", "m_scales", "s_scales"):
        assert torch.equal(getattr(mine, name), getattr(ref, name)), name


@pytest.mark.parametrize("compile_update", [True, False])
def test_the_engine_compiles_only_when_asked(compile_update):
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.conftest import tiny_config

    cfg = tiny_config(swap={"state": "compact", "compile_update": compile_update})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        kinds = {type(o.compiled) for o in engine.optimizers}
    finally:
        engine.close()
    assert kinds == ({CompiledChunkUpdate} if compile_update else {type(None)})


def test_the_engine_compiles_the_update_at_its_start_on_its_own_thread():
    """A unit of a whole chunk or more: the update compiles while the engine is built, on
    the thread that builds it (the training thread), not on the host worker during the
    first step (Dynamo is not thread-safe; the first update stalled for the compile)."""
    import threading

    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.conftest import tiny_config

    seen = []
    real = CompiledChunkUpdate.__call__

    def spy(self, *args):
        seen.append(threading.current_thread().name)
        return real(self, *args)

    # an embedding of 4096 x 256: one whole chunk
    cfg = tiny_config(model={"vocab_size": 4096, "d_model": 256, "tie_embeddings": False},
                      swap={"state": "compact", "compile_update": True})  # fmt: skip
    CompiledChunkUpdate.__call__ = spy
    try:
        engine = SwapEngine(cfg, CpuBackend(helper_threads=True), torch.float32)
        try:
            fused = engine.optimizers[0].compiled
            assert fused.compile_s is not None  # compiled before any step
            assert seen == [threading.current_thread().name]
        finally:
            engine.close()
    finally:
        CompiledChunkUpdate.__call__ = real


def _old_moments_and_master(grad, master, rem, m_codes, m_scales, s_codes, s_scales,
                            coef, lr_bc1, rbc2, lr_wd, b1: float, b2: float,
                            m_out, s_out) -> None:  # fmt: skip
    """moments_and_master as it was before issue 49 (int16 join/split in the loop)."""
    g = grad.float() * coef
    m = (m_codes.view(F8).float().view(-1, BLOCK) * m_scales.unsqueeze(1)).view(-1)
    s = (s_codes.view(F8).float().view(-1, BLOCK) * s_scales.unsqueeze(1)).view(-1)
    m = torch.lerp(m, g, 1 - b1)
    s = torch.sqrt(s * s * b2 + g * g * (1 - b2))
    m_out.copy_(m)
    s_out.copy_(s)
    p0 = join(master, rem)
    new_hi, new_rem = split(p0 + (-lr_bc1 * m / (s * rbc2 + ADAM_EPS) - lr_wd * p0))
    rem.copy_(new_rem)
    master.copy_(new_hi)


# 16 upper halves, one per copy of every remainder in a chunk: +-0, subnormals, the
# smallest normal, weights, a rounding that carries into the exponent, the largest finite
# of both signs, +-inf, NaNs (quiet and signalling, with payloads)
CHUNK_KINDS = [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x3C23, 0xBC23, 0x3F7F,
               0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC1, 0xFFA5, 0x7F81, 0x4B7F]  # fmt: skip


def _every_master_chunk() -> list:
    """One whole chunk: every remainder 16 times, each time under another kind of upper
    half (NaN with payloads, +-inf, subnormal, +-0, the largest finite, ...); moments of
    varied blocks; the arguments of the compiled update."""
    assert CHUNK == 16 * 65536
    g = torch.Generator().manual_seed(3)
    uppers = torch.tensor(CHUNK_KINDS, dtype=torch.int64).repeat_interleave(65536)
    bits = (uppers << 16) + torch.arange(-32768, 32768).repeat(16)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    master, rem = split(bits.view(torch.float32))
    grad = torch.randn(CHUNK, generator=g) * torch.exp(torch.randn(CHUNK, generator=g) * 4)
    grad = grad.bfloat16()
    codes = [torch.randint(0, 127, (CHUNK,), dtype=torch.uint8, generator=g) for _ in range(2)]
    scales = [torch.rand(CHUNK // BLOCK, generator=g) * 1e-3 for _ in range(2)]
    return [grad, master, rem, codes[0], scales[0], codes[1], scales[1]]


@pytest.mark.slow  # compiles the old kernel too: ~20 s each the first time on 2 cores
def test_the_compiled_update_gives_the_bits_it_gave_before_the_int32_form():
    """The compiled whole-chunk update (CompiledChunkUpdate: halves read as bf16, written
    to int32 scratch, narrowed eagerly) against the old formula compiled, on masters of
    every kind under every remainder: master, remainder and moments bit for bit."""
    args = _every_master_chunk()
    scalars = [torch.tensor(x) for x in (0.7, 1e-3, 1.3, 1e-4)]
    old = [a.clone() for a in args]
    m, s = torch.empty(CHUNK), torch.empty(CHUNK)
    torch.compile(_old_moments_and_master, dynamic=False, fullgraph=True)(
        *old, *scalars, 0.9, 0.95, m, s
    )
    torch.compile(encode_moments, dynamic=False, fullgraph=True)(m, s, *old[3:])
    new = [a.clone() for a in args]
    fused = CompiledChunkUpdate(0.9, 0.95)
    assert fused(*new, tuple(scalars)) and fused.compile_s is not None
    assert not torch.equal(new[1].view(torch.int16), args[1].view(torch.int16))  # it moved
    for name, a, b in zip(("master", "rem", "m_codes", "m_scales", "s_codes", "s_scales"),
                          new[1:], old[1:], strict=True):  # fmt: skip
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def _kernels(fn, *args) -> list[str]:
    """The C++ kernels Inductor generates for fn(*args) on the CPU."""
    from torch._inductor.utils import run_and_get_code

    _, code = run_and_get_code(torch.compile(fn, dynamic=False, fullgraph=True), *args)
    return re.findall(r"cpp_pybinding\((.*?)\'\'\'\)", "\n".join(code), re.S)


@pytest.mark.slow  # an Inductor compile: ~20 s the first time on 2 cores
def test_the_compiled_update_runs_as_vector_loops():
    """Inductor's C++ backend has no vector code for int16 and compiles a loop that loads,
    stores or casts one as scalar code (3x slower, issue 49): every kernel of both halves
    has no int16 in it and steps its innermost loop by a vector (at::vec::Vectorized)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if not pick_vec_isa():
        pytest.skip("Inductor finds no vector instructions on this CPU")
    grad, master, rem, *codes = _every_master_chunk()
    m, s = torch.empty(CHUNK), torch.empty(CHUNK)
    hi32, rem32 = torch.empty(2, CHUNK, dtype=torch.int32)
    scalars = [torch.tensor(x) for x in (0.7, 1e-3, 1.3, 1e-4)]
    update = _kernels(moments_and_master, grad, master, rem.view(torch.bfloat16), *codes,
                      *scalars, 0.9, 0.95, m, s, hi32, rem32)  # fmt: skip
    encode = _kernels(encode_moments, m, s, *codes)
    assert update and encode
    _assert_vector_loops(update + encode)


def _assert_vector_loops(kernels: list[str]) -> None:
    for src in kernels:
        assert "int16" not in src
        assert "at::vec::Vectorized" in src
        steps = re.findall(r"for\(int64_t (\w+)=.*?;\s*\1\+=static_cast<int64_t>\((\d+)L\)\)", src)
        assert steps and int(steps[-1][1]) > 1, steps  # the innermost loop: a vector's width
