"""The CUDA backend's D2H staging pool, over the fake torch.cuda (tests/fake_cuda.py).

    pytest tests/test_staging.py

The pool is one unit's gradient in the dtype that crosses, cut in chunks (it was three
whole buffers of the largest unit in fp32: 9.7 GB pinned for a 7B). A gradient crosses
chunk by chunk; the landing consumes each as it arrives and hands it back, so the next
unit's copy reuses it. What must hold: every byte lands where it belongs, whatever the
chunk boundaries and the tensors they cut; the pool never grows; a gradient too big for
the pool fails at once rather than waiting for chunks it would hold itself; compact
state's summed gradients cross in bf16 and train exactly as on the CPU backend.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom.optim import lr_at
from atom.swap import landing as landing_mod
from atom.swap.backend import CpuBackend, Transfer
from atom.swap.engine import SwapEngine
from atom.swap.units import aligned
from tests.conftest import tiny_config
from tests.fake_cuda import cuda_backend
from tests.test_swap_equivalence import batches_for, rel_err


def _gradient(sim, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(sizes))
    return [sim.device_tensor(torch.randn(n, generator=gen)) for n in sizes]


@pytest.mark.parametrize("sizes", [[37, 100, 5], [1], [256], [3, 3, 3, 3, 3, 3, 3, 3, 3]])
def test_pieces_reassemble_the_gradient_across_chunk_and_tensor_boundaries(monkeypatch, sizes):
    """A list is a unit's parameters: each lands where the unit's layout puts it (at an
    aligned offset); the padding between them never crosses."""
    backend, sim = cuda_backend(monkeypatch, 0, watch_host=False)
    backend.size_staging(256, torch.float32)  # 8 chunks of 128 bytes: 32 floats each
    try:
        grads = _gradient(sim, sizes)
        with sim.watch():
            t = backend.d2h(grads if len(grads) > 1 else grads[0], backend.record())
        places = [aligned(sum(aligned(n) for n in sizes[:k])) for k in range(len(sizes))]
        want = torch.full((places[-1] + sizes[-1],), float("nan"))
        for at, g in zip(places, grads, strict=True):
            want[at : at + g.numel()] = g
        landed = torch.full_like(want, float("nan"))
        with sim.host_watch():
            for offset, host in backend.host_pieces(t):
                landed[offset : offset + host.numel()] = host
        backend.release_host(t)
        assert torch.equal(landed.isnan(), want.isnan())
        assert torch.equal(landed.nan_to_num(), want.nan_to_num())
        assert backend._staging.qsize() == backend._staging_chunks  # all back
        assert sim.violations == []
    finally:
        backend.close()


def test_the_pool_is_one_unit_and_is_reused_piece_by_piece(monkeypatch):
    """Two gradients of a whole pool each: the second's copy takes the first's chunks as
    its landing hands them back (it would wait forever if they came back only at the
    end, with the first landing still going: one consumer, as the host worker)."""
    backend, sim = cuda_backend(monkeypatch, 0, watch_host=False)
    backend.size_staging(1024, torch.float32)
    pool = backend._chunk_bytes * backend._staging_chunks
    try:
        assert 1024 * 4 <= pool < 1024 * 4 + 512 * backend._staging_chunks
        first, second = _gradient(sim, [1024]), _gradient(sim, [1000, 24])
        with sim.watch():
            t1 = backend.d2h(first[0], backend.record())
        assert backend._staging.qsize() == 0  # the first gradient holds the whole pool
        pieces = backend.host_pieces(t1)
        landed = torch.empty(1024)
        with sim.host_watch():
            offset, host = next(pieces)
            landed[offset : offset + host.numel()] = host
            next_offset, host = next(pieces)  # asking for the next hands the first back
        assert backend._staging.qsize() == 1
        with sim.host_watch():
            landed[next_offset : next_offset + host.numel()] = host
            for offset, host in pieces:
                landed[offset : offset + host.numel()] = host
        backend.release_host(t1)
        with sim.watch():
            t2 = backend.d2h(second, backend.record())
        out = torch.empty(1024)
        with sim.host_watch():
            for offset, host in backend.host_pieces(t2):
                out[offset : offset + host.numel()] = host
        backend.release_host(t2)
        backend.release_host(t2)  # a second release is ignored: the pool does not grow
        assert torch.equal(landed, first[0]) and torch.equal(out, torch.cat(second))
        assert backend._staging.qsize() == backend._staging_chunks
        assert sim.violations == []
    finally:
        backend.close()


def test_a_gradient_larger_than_the_pool_fails_at_once(monkeypatch):
    backend, sim = cuda_backend(monkeypatch, 0, torch.bfloat16, watch_host=False)
    backend.size_staging(4096)  # bf16: 8 KiB
    try:
        (big,) = _gradient(sim, [4096])  # fp32 sums: twice the bytes the pool was sized for
        with sim.watch(), pytest.raises(RuntimeError, match="does not fit the .* staging pool"):
            backend.d2h(big, backend.record())
        assert backend._staging.qsize() == backend._staging_chunks  # nothing kept
    finally:
        backend.close()


def _config(state: str):
    return tiny_config(
        model={"arch": "llama", "n_kv_head": 2, "n_layer": 4, "d_model": 128},
        train={"grad_accum": 2, "grad_clip": 1.0},
        swap={"layers_per_unit": 1, "prefetch": 1, "state": state, "order": "unit"},
    )


@pytest.mark.parametrize("state", ["compact", "fp32"])
def test_the_engine_pins_its_units_and_one_unit_of_staging_and_trains_exactly(monkeypatch, state):
    """Unit-major with two micro-batches: each unit's gradient is summed on the device;
    in compact state it crosses in bf16 (the host gradient's dtype), in fp32 state in
    fp32. Pinned: the units' bus copies and one unit of staging, no more. The numbers
    are the CPU backend's."""
    cfg = _config(state)
    # compact: bf16 compute, as on a GPU (the sums would otherwise cross in fp32 compute's
    # width: the pool is the wider of the compute dtype and what is summed)
    dtype = torch.bfloat16 if state == "compact" else torch.float32
    ref = SwapEngine(cfg, CpuBackend(), dtype)
    try:
        want_losses = [ref.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                       for s in range(2)]  # fmt: skip
        want = ref.named_parameters()
    finally:
        ref.close()
    backend, sim = cuda_backend(monkeypatch, 0, dtype)
    engine = SwapEngine(cfg, backend, dtype)
    try:
        crossing = 2 if state == "compact" else 4
        largest = max(u.n_total for u in engine.units)
        bus = sum(b.compute.nbytes for b in engine.store.buffers)
        staging = backend._chunk_bytes * backend._staging_chunks
        assert largest * crossing <= staging < largest * crossing + 512 * 8
        pages = 4096 * (len(engine.store.buffers) + backend._staging_chunks + 1)  # alignment
        assert backend.pinned_bytes <= bus + staging + pages
        losses = []
        for s in range(2):
            with sim.watch():
                losses.append(engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss)
        engine.wait_idle()
        got = engine.named_parameters()
        sent = engine.d2h_bytes
    finally:
        engine.close()
    assert sim.violations == []
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for name, p in want.items():  # the invariant's 1e-5: fp32 sums in another order
        assert rel_err(got[name], p) <= 1e-5, name
    n_params = sum(p.numel() for p in want.values())
    assert sent <= 2 * n_params * crossing * 1.1  # two steps, each unit once per step


@pytest.mark.parametrize(
    "numel", [5, landing_mod.SCRATCH_ELEMENTS, 2 * landing_mod.SCRATCH_ELEMENTS + 7]
)
def test_a_bf16_gradient_adds_into_the_fp32_one_a_cache_sized_slice_at_a_time(numel):
    """Micro-batch-major's later landings add bf16 pieces into the fp32 host gradient
    through a scratch of SCRATCH_ELEMENTS, whole pieces and per-parameter lists alike:
    every element as torch's own widening add."""
    gen = torch.Generator().manual_seed(numel)
    grad = torch.randn(numel + 3, generator=gen)
    flat = torch.randn(numel, generator=gen).bfloat16()
    cut = numel // 3
    params = [(0, cut), (cut, numel - cut)]  # (offset, numel): two parameters
    pieces = [[(3, flat)], [(0, [flat[:cut], flat[cut:]])]]

    class Pieces:  # the backend's contract, on host memory
        def __init__(self, out):
            self.out = out

        def host_pieces(self, t):
            yield from self.out

        def release_host(self, t) -> None:
            pass

    for out in pieces:
        g = grad.clone()
        offset = out[0][0]
        entries = [SimpleNamespace(offset=offset + o, numel=n, shape=(n,)) for o, n in params]
        landing = landing_mod.GradientLanding(Pieces(out), [g], [entries])
        landing.land(0, Transfer(), first=False)
        expected = grad.clone()
        expected[offset : offset + numel] += flat.float()
        assert torch.equal(g, expected)
        assert landing._scratch.numel() == landing_mod.SCRATCH_ELEMENTS
