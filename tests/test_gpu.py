"""CUDA backend checks; skipped without a GPU.

    pytest -m gpu tests/test_gpu.py

Swapped equals resident in fp32 through real streams, events and pinned memory; bf16
swapped training tracks fp32; the resident bound holds in torch's own allocator figures.
"""

from __future__ import annotations

import pytest
import torch

from atom.optim import lr_at
from atom.resident.engine import ResidentEngine
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


def test_a_resident_run_resumes_on_cuda():
    """A --resident checkpoint loaded into a fresh CUDA engine takes its next step (the
    fused CUDA AdamW refused the CPU `step` init_state made) and continues like the
    unbroken run."""
    cfg = tiny_config(train={"device": "cuda"})
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    first = ResidentEngine(cfg, dev, torch.float32)
    for step in range(2):
        first.train_step(batches_for(step, cfg), lr_at(step, cfg.train))
    tensors = {k: v.clone() for _, files in first.state_files() for k, v in files.items()}
    resumed = ResidentEngine(cfg, dev, torch.float32)
    resumed.load_state(tensors.__getitem__, has_optim=True, steps=first.optimizer_steps())
    lr = lr_at(2, cfg.train)
    a = resumed.train_step(batches_for(2, cfg), lr).loss
    b = first.train_step(batches_for(2, cfg), lr).loss
    assert abs(a - b) / b <= 1e-5
    for name, p in first.named_parameters().items():
        assert rel_err(resumed.named_parameters()[name], p) <= 1e-5, name
