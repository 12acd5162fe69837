"""Where training runs and in what precision: the device and compute dtype a config asks
for, resolved against this machine. Below the trainer, the profiler and the tools alike,
so none of them reaches into another for it."""

from __future__ import annotations

import torch

from atom.config import Config, ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cuda_has_bf16() -> bool:
    """bf16 in the GPU's tensor cores (Ampere and newer). `torch.cuda.is_bf16_supported()`
    counts emulation by default, and says yes on a V100, T4 or RTX 20-series, which run
    bf16 matmuls several times slower than fp16: those get fp16 with loss scaling."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a torch without the argument: tensor cores with bf16 are sm_80+
        return torch.cuda.get_device_capability()[0] >= 8


def resolve_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    """auto: CUDA when present; bf16 where the GPU has it, fp16 (with loss scaling) where it
    does not (RTX 20-series), fp32 on CPU."""
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            "train.device is cuda but no CUDA device is visible; use --set "
            "train.device=cpu or install a CUDA build of torch"
        )
    device = torch.device(want)
    if device.type == "cuda" and device.index is None:
        # an index everywhere: torch.cuda.set_device and per-device stats refuse a bare "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    if cfg.train.dtype != "auto":
        dtype = DTYPES[cfg.train.dtype]
    elif device.type == "cuda":
        dtype = torch.bfloat16 if cuda_has_bf16() else torch.float16
    else:
        dtype = torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("train.dtype=fp16 is for GPUs without bf16; use fp32 or bf16 on CPU")
    return device, dtype
