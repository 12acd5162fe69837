"""Device resolution and the CUDA backend's setup, on CPU with the few torch.cuda calls faked.

    pytest tests/test_device.py

Every CUDA run used to crash at start: `auto` resolved to a bare torch.device("cuda"),
which torch.cuda.set_device and per-device memory stats refuse. These tests fail on that.
"""

from __future__ import annotations

import pytest
import torch

from atom.train import resolve_device
from tests.conftest import tiny_config


class _FakeCuda:
    """What resolve_device and CudaBackend.__init__ ask of torch.cuda, answered like a
    machine whose current CUDA device is `current`; set_device refuses unindexed devices
    exactly as torch does."""

    def __init__(self, current: int = 0, bf16: bool = True):
        self.current, self.bf16, self.set_to = current, bf16, None

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: self.bf16)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("stream", device))

    def set_device(self, device) -> None:
        device = torch.device(device)
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index, got {device}")
        self.set_to = device


@pytest.mark.parametrize("asked,expected", [("auto", "cuda:0"), ("cuda", "cuda:0"),
                                            ("cuda:1", "cuda:1")])  # fmt: skip
def test_cuda_devices_resolve_with_an_index(monkeypatch, asked, expected):
    _FakeCuda(current=0).install(monkeypatch)
    device, dtype = resolve_device(tiny_config(train={"device": asked, "dtype": "auto"}))
    assert str(device) == expected and device.index is not None
    assert dtype == torch.bfloat16


def test_the_current_device_is_the_one_resolved(monkeypatch):
    _FakeCuda(current=2, bf16=False).install(monkeypatch)
    device, dtype = resolve_device(tiny_config(train={"device": "auto", "dtype": "auto"}))
    assert str(device) == "cuda:2"
    assert dtype == torch.float16  # no bf16 (RTX 20-series): fp16 with loss scaling


def test_cuda_backend_accepts_a_bare_cuda_device(monkeypatch):
    """A caller holding torch.device("cuda") (tests, tools) still gets an indexed backend;
    pinned staging is faked by plain host memory."""
    from atom.swap import backend as backend_mod

    fake = _FakeCuda(current=0)
    fake.install(monkeypatch)
    real_empty = torch.empty
    monkeypatch.setattr(
        backend_mod.torch,
        "empty",
        lambda *a, pin_memory=False, **k: real_empty(*a, **k),
    )
    b = backend_mod.CudaBackend(torch.device("cuda"), 16, torch.bfloat16, staging_buffers=1)
    try:
        assert b.device == torch.device("cuda", 0)
        assert fake.set_to == torch.device("cuda", 0)
    finally:
        b.close()
