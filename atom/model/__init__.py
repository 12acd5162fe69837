"""Pure nn.Module models: embed + blocks + head. No swap or peer code in here."""

from __future__ import annotations

import torch

from atom.config import ModelConfig
from atom.model.common import LanguageModel, init_parameter, lm_loss, materialize
from atom.model.gpt import build_gpt
from atom.model.llama import build_llama


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> LanguageModel:
    """Build on `device` without initialising (meta by default: no memory at all)."""
    builder = build_gpt if cfg.arch == "gpt" else build_llama
    with torch.device(device):
        return builder(cfg)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "LanguageModel",
    "build_model",
    "count_parameters",
    "init_parameter",
    "lm_loss",
    "materialize",
]
