"""The config a command runs with: a file or configs/ name, --set overrides, and, where the
model section names a Hugging Face checkpoint (`model: hf:PATH`, `--model PATH`, or a mapping
with init_from), that checkpoint's config.json filling the model section and checked.

Above both atom.config (the ground floor, which knows nothing of Hugging Face) and atom.hf.
And what a run's config asks of the host: its RAM for model state, refused up front when
it does not fit (the profiler's account, plus the peers' outer optimizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from atom.config import (
    Config,
    ConfigError,
    apply_overrides,
    names_hf_model,
    read_config_file,
    replace,
)

if TYPE_CHECKING:
    import torch  # the CLI imports this module at start: torch only once a command needs it


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


def host_bytes_needed(cfg: Config, dtype: torch.dtype) -> tuple[int, int]:
    """(parameters, host bytes for model state): the profiler's account, so that the
    refusal here and `atom profile`'s host-RAM column never disagree, plus, training with
    peers under an outer optimizer, its outer weights and momentum (fp32, 8 bytes a
    parameter; `atom profile` plans one machine and leaves them out)."""
    from atom.profiler.analysis import ModelAnalysis

    a = ModelAnalysis.of(cfg)
    disk = cfg.swap.disk_dir is not None
    need = a.host_bytes(dtype, cfg.swap.state, disk, cfg.swap.disk_slots)
    need -= card_grad_bytes(cfg) + card_kept_bytes(cfg, dtype)
    return a.n_params, need + outer_state_bytes(cfg, a.n_params)


def _card_units(cfg: Config) -> tuple[list, set[int]]:
    """(the units, those updated on the device), chosen as the engine chooses them
    (atom/swap/card_update.py parse_units)."""
    from atom.model import build_model
    from atom.swap.card_update import parse_units
    from atom.swap.units import partition

    units = partition(build_model(cfg.model, device="meta"), cfg.swap.layers_per_unit)
    try:
        return units, parse_units(cfg.swap.card_update, units)
    except ValueError as err:  # as the engine words it (atom/swap/engine.py)
        raise ConfigError(str(err)) from None


def card_grad_bytes(cfg: Config) -> int:
    """The host gradient the units updated on the device (swap.card_update) do not have
    (atom/swap/host_store.py allocates none; their gradient stays on the device): n_total
    elements of the master's dtype (4 bytes, 2 in compact and bf16 state) per card unit."""
    if cfg.swap.card_update.strip() in ("", "none"):
        return 0  # no second meta build of the model
    units, card = _card_units(cfg)
    per = 4 if cfg.swap.state == "fp32" else 2  # fp32 or bf16, the master's dtype
    return sum(units[u].n_total for u in card) * per


def card_kept_bytes(cfg: Config, dtype: torch.dtype) -> int:
    """The host copy of the weights that units kept on the card (resident across steps,
    swap.resident_units, and updated there) do not have: their weights live in their
    device slot alone (atom/swap/host_store.py kept_host_bytes, per unit)."""
    if cfg.swap.card_update.strip() in ("", "none") or cfg.swap.resident_units < 1:
        return 0
    from atom.swap.host_store import kept_host_bytes

    units, card = _card_units(cfg)
    n = len(units)  # the block units nearest the head (atom/swap/engine.py)
    kept = card & set(range(n - 1 - cfg.swap.resident_units, n - 1))
    paged = cfg.swap.disk_dir is not None
    return sum(kept_host_bytes(units[u], dtype, cfg.swap.state, paged) for u in kept)


def outer_state_bytes(cfg: Config, n_params: int) -> int:
    """Host RAM the gossip keeps beside the model: the outer optimizer's weights and
    momentum (atom/gossip/merge.py DiLoCoMerge), and with codec topk one reference per
    partner (atom/gossip/pairref.py; noloco's payload is twice the weights)."""
    from atom.gossip.merge import OUTER_DEFAULTS

    if not cfg.gossip.enabled:
        return 0
    g = cfg.gossip
    outer = 8 * n_params if g.strategy in OUTER_DEFAULTS else 0
    per_ref = 4 * n_params * (2 if g.strategy == "noloco" else 1)
    return outer + (g.topk_partners * per_ref if g.codec == "topk" else 0)


def check_host_memory(cfg: Config, dtype: torch.dtype) -> int:
    """Refuse up front, with the numbers, a run whose host buffers cannot fit in RAM."""
    import psutil

    n_params, need = host_bytes_needed(cfg, dtype)
    available = psutil.virtual_memory().available
    outer_bytes = outer_state_bytes(cfg, n_params)
    outer = (
        f" (of which {outer_bytes / 2**30:.1f} GiB the gossip's, gossip.strategy "
        f"{cfg.gossip.strategy}, codec {cfg.gossip.codec}; plain averaging, gossip.strategy"
        f" gossip, with codec int8 needs none)"
        if outer_bytes
        else ""
    )
    if need > available:
        fix = "choose a smaller model or add RAM"
        for sets, what in (
            ({"state": "compact"}, "bf16 weights, 8-bit optimizer state"),
            ({"disk_dir": "DIR"}, "weights and optimizer state on a fast disk"),
            ({"state": "compact", "disk_dir": "DIR"}, "both"),
        ):
            if all(getattr(cfg.swap, k) == v for k, v in sets.items()):
                continue
            try:
                leaner = host_bytes_needed(replace(cfg, swap=sets), dtype)[1]
            except ConfigError:  # that setting is not allowed with this config anyway
                continue
            if leaner < need and leaner <= available:
                flags = " ".join(f"--set swap.{k}={v}" for k, v in sets.items())
                fix = f"{flags} needs {leaner / 2**30:.1f} GiB ({what}), or add RAM"
                break
        raise ConfigError(
            f"this model ({n_params / 1e9:.2f}B parameters, swap.state={cfg.swap.state}"
            f"{', NVMe tier' if cfg.swap.disk_dir else ''}) needs "
            f"{need / 2**30:.1f} GiB of host RAM for weights, gradients and optimizer state"
            f"{outer}, but only {available / 2**30:.1f} GiB is available; {fix}"
        )
    return need
