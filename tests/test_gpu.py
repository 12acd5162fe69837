"""CUDA backend checks; skipped without a GPU.

    pytest -m gpu tests/test_gpu.py

Swapped equals resident in fp32 through real streams, events and pinned memory; bf16
swapped training tracks fp32; the resident bound holds in torch's own allocator figures.
"""

from __future__ import annotations

import pytest
import torch

from atom.optim import lr_at
from atom.resident import ResidentEngine
from atom.swap.backend import CudaBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_swap_equivalence import STEPS, batches_for, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_engine(cfg, dtype):
    from atom.model import build_model
    from atom.swap.units import partition

    largest = max(u.n_total for u in partition(build_model(cfg.model), cfg.swap.layers_per_unit))
    return SwapEngine(cfg, CudaBackend(torch.device("cuda"), largest, dtype), dtype)


@pytest.mark.parametrize("prefetch,ckpt", [(1, True), (2, False)])
def test_cuda_swapped_matches_resident_fp32(prefetch, ckpt):
    cfg = tiny_config(
        train={"device": "cuda", "grad_accum": 2}, swap={"prefetch": prefetch, "checkpoint": ckpt}
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    swapped = cuda_engine(cfg, torch.float32)
    resident = ResidentEngine(cfg, torch.device("cuda"), torch.float32)
    try:
        for step in range(STEPS):
            lr = lr_at(step, cfg.train)
            a = swapped.train_step(batches_for(step, cfg), lr).loss
            b = resident.train_step(batches_for(step, cfg), lr).loss
            assert abs(a - b) / b <= 1e-5
        params = swapped.named_parameters()
        for name, p in resident.named_parameters().items():
            assert rel_err(params[name], p.cpu()) <= 1e-5, name
        assert swapped.slots.max_resident <= prefetch + 1
    finally:
        swapped.close()


def test_cuda_bf16_tracks_fp32():
    cfg = tiny_config(train={"device": "cuda"})
    swapped = cuda_engine(cfg, torch.bfloat16)
    resident = ResidentEngine(cfg, torch.device("cuda"), torch.float32)
    try:
        for step in range(STEPS):
            lr = lr_at(step, cfg.train)
            a = swapped.train_step(batches_for(step, cfg), lr).loss
            b = resident.train_step(batches_for(step, cfg), lr).loss
            assert abs(a - b) / b < 2e-2
    finally:
        swapped.close()
