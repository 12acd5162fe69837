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


# What a resumed run may not change: what its checkpoint is made of and from.
_FIXED = {"model": "model config", "train.data": "data", "train.seed": "seed"}


def resume_run_config(saved: dict, overrides: list[str], max_steps: int | None = None) -> Config:
    """The config a resumed run continues with: the one saved in its checkpoint, with the
    `--set` overrides (and --max-steps) named on the command line on top.

    Changing a run's length (--max-steps other than the saved max_steps, lr_decay_steps
    unset) keeps the schedule it was planned with, so the steps it trains are the ones the
    planned run would have: extended, the LR has decayed to min_lr by the old end and stays
    there; shortened, it stops early on the planned curve. A cosine re-fitted to the new
    length would jump the LR at the resumed step."""
    before = Config.from_dict(saved)
    data = apply_overrides(before.to_dict(), overrides)
    if max_steps is not None:
        data["train"]["max_steps"] = max_steps
    cfg = Config.from_dict(data)
    if cfg.train.lr_decay_steps is None and cfg.train.max_steps != before.train.max_steps:
        cfg.train.lr_decay_steps = before.train.max_steps
    return cfg


def resume_changes(saved: dict, cfg: Config) -> list[str]:
    """One line per value a resumed run changes against its saved config; a changed model,
    data or seed is refused (ConfigError)."""
    from atom.config import ConfigError

    before, after = Config.from_dict(saved).to_dict(), cfg.to_dict()
    bt, at = before["train"], after["train"]
    # resume_run_config pinned the decay to the planned length: one line says both
    pinned = (
        bt["lr_decay_steps"] is None
        and at["max_steps"] != bt["max_steps"]
        and at["lr_decay_steps"] == bt["max_steps"]
    )
    changes = []
    for section, values in after.items():
        for key, value in values.items():
            old, name = before[section][key], f"{section}.{key}"
            if old == value:
                continue
            fixed = _FIXED.get(section) or _FIXED.get(name)
            if fixed:
                raise ConfigError(
                    f"the run was trained with a different {fixed} ({name} {old!r}, not "
                    f"{value!r}); --resume continues it as saved: drop that --set, or start "
                    "a new run with another --out"
                )
            if pinned and name == "train.lr_decay_steps":
                continue
            if pinned and name == "train.max_steps":
                after_end = (
                    "stays at min_lr after it"
                    if value > old
                    else f"stops at step {value}, above min_lr"
                )
                changes.append(
                    f"train.max_steps: {old} -> {value}; the LR keeps its planned decay over "
                    f"{old} steps and {after_end} (--set train.lr_decay_steps=N plans another)"
                )
            else:
                changes.append(f"{name}: {old!r} -> {value!r}")
    return changes
