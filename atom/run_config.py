"""The config a command runs with: a file or configs/ name, --set overrides, and, where the
model section names a Hugging Face checkpoint (`model: hf:PATH`, `--model PATH`, or a mapping
with init_from), that checkpoint's config.json filling the model section and checked.

Above both atom.config (the ground floor, which knows nothing of Hugging Face) and atom.hf.
"""

from __future__ import annotations

from pathlib import Path

from atom.config import Config, apply_overrides, names_hf_model, read_config_file


def load_run_config(
    path: str | Path | None = None, overrides: list[str] | None = None, model: str | None = None
) -> Config:
    """`model` (atom train --model PATH) replaces the model section with hf:PATH."""
    data = read_config_file(path) if path is not None else {}
    if model is not None:
        data["model"] = model if model.startswith("hf:") else f"hf:{model}"
    hf = names_hf_model(data.get("model"))
    if hf:
        from atom.hf import expand_model_section  # torch and safetensors: only when needed

        data["model"] = expand_model_section(data["model"])
    cfg = Config.from_dict(apply_overrides(data, overrides or []))
    if hf or cfg.model.init_from:
        from atom.hf import check_config

        check_config(cfg)
    return cfg
