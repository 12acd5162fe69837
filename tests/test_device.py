"""Device resolution and the CUDA backend's setup, on CPU with the few torch.cuda calls faked.

    pytest tests/test_device.py

Every CUDA run used to crash at start: `auto` resolved to a bare torch.device("cuda"),
which torch.cuda.set_device and per-device memory stats refuse. These tests fail on that.
"""

from __future__ import annotations

import gc

import pytest
import torch

from atom.ground.device import resolve_device
from tests.conftest import tiny_config


class _FakeCuda:
    """What resolve_device and CudaBackend.__init__ ask of torch.cuda, answered like a
    machine whose current CUDA device is `current`; set_device refuses unindexed devices
    exactly as torch does."""

    def __init__(self, current: int = 0, bf16: bool = True, emulated_bf16: bool = False):
        self.current, self.bf16, self.set_to = current, bf16, None
        self.emulated_bf16 = emulated_bf16  # a T4 / V100 / RTX 20: bf16 only by emulation

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", self.is_bf16_supported)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("stream", device))

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        # torch's own answer: emulation counts unless the caller says it does not
        return self.bf16 or (self.emulated_bf16 and including_emulation)

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


def test_cards_with_bf16_only_by_emulation_get_fp16(monkeypatch):
    """torch.cuda.is_bf16_supported() says yes on a T4 (emulation); atom, the profiler's
    measured spec and the DeepSpeed baseline must all pick fp16 with loss scaling there."""
    from tools.baselines.deepspeed_baseline import ds_config

    _FakeCuda(bf16=False, emulated_bf16=True).install(monkeypatch)
    assert torch.cuda.is_bf16_supported()  # what used to decide
    cfg = tiny_config(train={"device": "cuda", "dtype": "auto"})
    assert resolve_device(cfg)[1] == torch.float16
    ds = ds_config(cfg, stage=3)
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    _FakeCuda(bf16=True).install(monkeypatch)
    assert resolve_device(cfg)[1] == torch.bfloat16
    assert ds_config(cfg, stage=2)["bf16"]["enabled"]


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
    b = backend_mod.CudaBackend(torch.device("cuda"), 16, torch.bfloat16, staging_chunks=1)
    try:
        assert b.device == torch.device("cuda", 0)
        assert fake.set_to == torch.device("cuda", 0)
    finally:
        b.close()


class _FakeCudart:
    """torch.cuda.cudart() as far as the pinned arena uses it: records registrations."""

    def __init__(self, fail: bool = False):
        self.registered: dict[int, int] = {}
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.registered.pop(ptr)
        return 0


def test_pinned_arena_is_one_registration_sized_like_its_buffers(monkeypatch):
    from atom.swap.pinned import ALIGN, PinnedArena

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    requests = [(3_000_001, torch.bfloat16), (12_345, torch.float32), (7, torch.bfloat16),
                (2_000_000, torch.float32)]  # fmt: skip
    arena = PinnedArena(requests)
    want = sum(n * torch.empty(0, dtype=dt).element_size() for n, dt in requests)
    assert len(cudart.registered) == 1
    ((ptr, size),) = cudart.registered.items()
    assert ptr % ALIGN == 0 and size == arena.nbytes
    assert want <= arena.nbytes <= want * 1.05  # no power-of-two rounding
    spans = []
    for t, (n, dt) in zip(arena.slices, requests, strict=True):
        assert t.numel() == n and t.dtype == dt and t.data_ptr() % ALIGN == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
        assert ptr <= spans[-1][0] and spans[-1][1] <= ptr + size
    spans.sort()
    # no two buffers overlap
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    for i, t in enumerate(arena.slices):
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(arena.slices))
    keep = arena.slices[1]
    del arena
    assert len(cudart.registered) == 1  # a slice still views the memory: still pinned
    del keep, t
    gc.collect()
    assert cudart.registered == {}  # the last view gone: unregistered before it is freed


def test_swap_engine_on_cuda_pins_its_units_in_one_arena(monkeypatch):
    """HostStore asks the CUDA backend for every bus buffer at once: the pinned bytes are
    the units' compute copies plus the D2H staging pool (one unit's gradient in the
    compute dtype, what crosses when nothing is summed on the device), within 5%."""
    from atom.model import build_model
    from atom.swap import backend as backend_mod
    from atom.swap.host_store import HostStore
    from atom.swap.units import partition

    _FakeCuda().install(monkeypatch)
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    cfg = tiny_config(model={"n_layer": 4, "d_model": 128})
    units = partition(build_model(cfg.model, device="meta"), 1)
    largest = max(u.n_total for u in units)
    b = backend_mod.CudaBackend(torch.device("cuda"), largest, torch.bfloat16)
    try:
        store = HostStore(units, b, torch.bfloat16)
        units_bytes = sum(u.n_total for u in units) * 2
        staging = largest * 2
        assert len(cudart.registered) == 1
        assert units_bytes + staging <= b.pinned_bytes <= (units_bytes + staging) * 1.05
        assert all(buf.compute.dtype == torch.bfloat16 for buf in store.buffers)
    finally:
        b.close()


def test_a_refused_registration_falls_back_to_per_buffer_pinning(monkeypatch):
    from atom.swap import pinned

    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(fail=True))
    pinned_calls = []
    real_empty = torch.empty

    def fake_empty(*a, pin_memory=False, **k):
        if pin_memory:
            pinned_calls.append(a)
        return real_empty(*a, **k)

    monkeypatch.setattr(pinned.torch, "empty", fake_empty)
    arena, bufs = pinned.allocate([(10, torch.float32), (4, torch.bfloat16)])
    assert arena is None and len(pinned_calls) == 2
    assert [b.numel() for b in bufs] == [10, 4]
