"""Run configuration: dataclasses per concern, loaded from YAML, overridden with --set.

The defaults *are* the tiny CPU demo, so `atom train` with no arguments needs no file.
Every field is validated in __post_init__ (ValueError; settings that take one of a few
words are `Literal` and checked by choices.py) and again across sections in
`Config.validate`; the CLI turns those into one-line errors with exit code 2.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from atom.config.choices import check_choices, choices_of
from atom.config.gossip import GossipConfig
from atom.ground.errors import ConfigError  # noqa: F401  (re-exported: callers import it from here too)

# configs/ at the top of a checkout; installed (pip install ., a wheel) it is atom/configs
_HERE = Path(__file__).resolve()
CONFIG_DIR = next(
    (d for d in (_HERE.parents[2] / "configs", _HERE.parents[1] / "configs") if d.is_dir()),
    _HERE.parents[2] / "configs",
)
LOGGERS = ("jsonl", "csv", "tensorboard", "wandb")  # train.logger (atom/run/loggers.py)


@dataclass
class ModelConfig:
    arch: Literal["gpt", "llama"] = "gpt"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # llama grouped-query attention; None = n_head
    d_model: int = 128
    d_ff: int | None = None  # None: 4*d (gpt) or the LLaMA 8/3*d rounded to multiple_of
    vocab_size: int = 256
    seq_len: int = 128
    bias: bool = False  # gpt only: biases in Linear and LayerNorm
    gelu: Literal["none", "tanh"] = "none"  # gpt only: none = exact GELU; tanh = GPT-2's
    qkv_bias: bool = False  # llama only: biases on q/k/v projections (Qwen2)
    tie_embeddings: bool | None = None  # None: True for gpt, False for llama
    rope_theta: float = 10000.0
    # llama only: RoPE frequency scaling, as Hugging Face's rope_scaling/rope_parameters:
    # "default" (none), "linear" (every frequency / rope_factor: positions stretched), or
    # "llama3" (Llama 3.1+: low frequencies / rope_factor, high ones kept, a smooth ramp
    # between, from rope_low_freq_factor, rope_high_freq_factor and the original context),
    # or "yarn" (YaRN, Qwen2.5's long context: frequencies blended between kept and
    # divided over a ramp set by rope_beta_fast/slow, cos/sin scaled by the attention factor)
    rope_type: Literal["default", "linear", "llama3", "yarn"] = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None  # yarn; None: 0.1 ln(rope_factor) + 1
    rope_truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    # llama only: each token attends to the last `sliding_window` positions (itself
    # included), as Mistral (and Qwen2 with every layer sliding) do; None: full causal
    sliding_window: int | None = None
    norm_eps: float = 1e-5
    multiple_of: int = 256  # llama d_ff rounding
    init_std: float = 0.02
    init_from: str | None = None  # a Hugging Face checkpoint dir (model: hf:PATH); see atom/hf/

    def __post_init__(self) -> None:
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("model.init_from must be a checkpoint directory or null")
        check_choices(self, "model")
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ValueError(
                f"model.n_kv_head ({self.n_kv_head}) must divide model.n_head ({self.n_head})"
            )
        if self.sliding_window is not None and (self.sliding_window < 1 or self.arch != "llama"):
            raise ValueError("model.sliding_window must be >= 1, and applies to arch llama")
        if self.rope_type == "yarn" and not (
            self.rope_beta_fast > 0 and self.rope_beta_slow > 0
            and (self.rope_attention_factor is None or self.rope_attention_factor > 0)
        ):  # fmt: skip
            raise ValueError("yarn RoPE needs rope_beta_fast, rope_beta_slow, attention factor > 0")
        if self.rope_type != "default" and self.arch != "llama":
            raise ValueError("model.rope_type applies to arch llama (gpt has learned positions)")
        if self.rope_factor < 1 or self.rope_original_max_position < 1:
            raise ValueError("model.rope_factor and rope_original_max_position must be >= 1")
        if self.rope_type == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ValueError("llama3 RoPE needs 0 < rope_low_freq_factor < rope_high_freq_factor")
        if self.arch == "llama" and (self.d_model // self.n_head) % 2:
            raise ValueError("llama needs an even head dimension (d_model / n_head) for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def tied(self) -> bool:
        return self.arch == "gpt" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.arch == "gpt":
            return 4 * self.d_model
        hidden = int(2 * (4 * self.d_model) / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


@dataclass
class TrainConfig:
    micro_batch: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    lr_decay_steps: int | None = None  # None: max_steps
    max_steps: int = 300
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # global-norm clip; 0 disables (lets updates overlap backward)
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # torch.compile the transformer blocks (atom/model/compiled_blocks.py): auto = on CUDA,
    # where Inductor's fused kernels pay for the minute the first compile takes; on = on the
    # CPU too; off = eager. Where they do not compile, a warning and eager blocks.
    compile_blocks: Literal["auto", "on", "off"] = "auto"
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # compute dtype on the device
    optimizer: Literal["adamw", "deepspeed"] = "adamw"  # torch fused | DeepSpeedCPUAdam
    eval_interval: int = 100
    eval_batches: int = 10
    log_interval: int = 10  # a log line every N steps when there is no progress bar
    ckpt_interval: int = 100
    keep_checkpoints: int = 3
    data: str = "default"  # "default" (stdlib corpus, no download) or a dir made by `atom prepare`
    # metrics besides metrics.jsonl: comma-separated csv, tensorboard, wandb (atom/run/loggers.py)
    logger: str = "jsonl"
    # a weight beyond this (or not finite) means the run diverged or was poisoned: it stops,
    # and no checkpoint is written with it (atom/run/guard.py)
    max_abs_weight: float = 1e6

    def __post_init__(self) -> None:
        for name in ("micro_batch", "grad_accum", "max_steps", "eval_batches", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_interval", "ckpt_interval", "warmup_steps", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(
                f"need 0 <= train.min_lr <= train.lr and lr > 0 (lr={self.lr}, "
                f"min_lr={self.min_lr})"
            )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("train.beta1 and train.beta2 must be in [0, 1)")
        if not self.max_abs_weight > 0:
            raise ValueError(f"train.max_abs_weight must be > 0, got {self.max_abs_weight}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("train.grad_clip and train.weight_decay must be >= 0")
        check_choices(self, "train")
        unknown = [n for n in self.logger.split(",") if n.strip() and n.strip() not in LOGGERS]
        if unknown:
            raise ValueError(
                f"train.logger: unknown {unknown[0].strip()!r}; a comma-separated choice of "
                f"{', '.join(LOGGERS)}"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"train.device must be auto|cpu|cuda|cuda:N, got {self.device!r}")


@dataclass
class SwapConfig:
    layers_per_unit: int = 1
    prefetch: int = 1  # units loaded ahead of the one computing; slots = prefetch + 1
    checkpoint: bool = True  # keep only unit inputs in forward, recompute in backward
    offload_activations: bool = False  # with checkpoint: keep those unit inputs in host memory
    # with offload_activations: the inputs of the last `acts_on_card` block units (those
    # nearest the head, whose backward comes first) stay on the device: no round trip for
    # the inputs needed back soonest, where device memory allows (`atom profile` sizes it)
    acts_on_card: int = 0
    # with offload_activations and disk_dir: units (card_update's syntax: none, all, or
    # indices such as 1-20) whose offloaded inputs go on to the NVMe tier instead of host
    # RAM, written behind the forward and read ahead of the backward
    # (atom/swap/activations.py); for steps whose kept inputs fit neither card nor RAM
    disk_acts: str = "none"
    # With grad_accum > 1: "unit" runs every micro-batch through a unit while it is loaded
    # (weights cross the bus and gradients come back once per step; the boundary
    # activations of all micro-batches are kept), "micro" runs micro-batch after
    # micro-batch (one micro-batch's activations; weights and gradients move per micro-batch).
    order: Literal["unit", "micro"] = "unit"
    # "exact": updates wait for the global gradient norm (clipping), equal to plain PyTorch.
    # "eager": each unit updates as soon as its gradients land, clipped by the previous
    # step's norm: equal to exact training whenever no step is clipped; hides the optimizer.
    update: Literal["exact", "eager"] = "exact"
    # Block units kept on the device for the whole step in extra slots (those nearest the
    # head): loaded once per step instead of once per micro-batch pass. For micro-batch-
    # major plans with device memory to spare; slots = prefetch + 1 + resident_units.
    resident_units: int = 0
    # Host state per parameter. "fp32": fp32 master, gradient and Adam moments (16 bytes,
    # plus the compute-dtype copy for the bus); training equals plain PyTorch. "compact":
    # the fp32 master as bf16 + a 16-bit remainder (exact), bf16 gradient, 8-bit
    # block-scaled moments (8 bytes, and the bf16 half doubles as the bus copy): for models
    # whose fp32 state does not fit host RAM (atom/optim/compact.py). `atom profile` picks
    # it when fp32 does not fit. "bf16" (opt in; atom/optim/bf16.py): the bf16 weights are
    # the master (no remainder), 8-bit moments, bf16 gradient, updates rounded to bf16
    # stochastically (seeded per unit and step: a resume is exact): 4 bytes a parameter
    # (6 with the gradient), lighter than compact and not bit-exact to fp32.
    state: Literal["fp32", "compact", "bf16"] = "fp32"
    # compact state: update whole chunks of a unit (2^20 parameters) with one loop compiled
    # by torch.compile (needs a C++ compiler; the first run compiles for ~30 s, later runs
    # read Inductor's cache); where it does not compile, a warning and the eager update.
    # false: the eager update always (bit-for-bit the same as before the compiled one)
    compile_update: bool = True
    # NVMe tier: a directory on a fast disk for each unit's master weights and optimizer
    # moments (12 bytes per parameter in fp32 state, 6 compact); RAM keeps the bus copy and
    # the gradient, and `disk_slots` units' state around their updates (read ahead, written
    # behind). None: everything in RAM. Working state only: checkpoints are separate.
    # Units updated on the device (card_update) page theirs the same way, around the update.
    disk_dir: str | None = None
    disk_slots: int = 3
    # Units whose optimizer update runs on the device (atom/swap/card_update.py): "none",
    # "all" (every unit not tied to another), or indices such as "1-30". The gradient stays
    # on the device and the unit's state crosses the bus for the update instead (compact
    # state: ~4 bytes a parameter each way): for small batches, where the host's update of
    # every parameter each step is the bottleneck.
    card_update: str = "none"
    # with disk_dir: card-updated units (card_update's syntax) whose compute copy, the
    # weights that cross the bus, lives on the NVMe tier instead of RAM: read before each
    # load (forward and backward), written once by the unit's update (atom/swap/weights.py);
    # for models whose bus copy does not fit RAM. Not resident, host-updated or tied units
    disk_weights: str = "none"

    def __post_init__(self) -> None:
        if self.disk_slots < 2:
            raise ValueError(f"swap.disk_slots must be >= 2, got {self.disk_slots}")
        if self.disk_dir is not None and not self.disk_dir.strip():
            raise ValueError("swap.disk_dir must be a directory or null")
        check_choices(self, "swap")
        if self.resident_units < 0:
            raise ValueError(f"swap.resident_units must be >= 0, got {self.resident_units}")
        if self.layers_per_unit < 1:
            raise ValueError(f"swap.layers_per_unit must be >= 1, got {self.layers_per_unit}")
        if self.prefetch < 0:
            raise ValueError(f"swap.prefetch must be >= 0, got {self.prefetch}")
        if self.acts_on_card < 0:
            raise ValueError(f"swap.acts_on_card must be >= 0, got {self.acts_on_card}")
        if self.offload_activations and not self.checkpoint:
            raise ValueError(
                "swap.offload_activations needs swap.checkpoint: true (only the "
                "checkpointed unit inputs are offloaded)"
            )
        if self.disk_acts.strip() not in ("", "none") and not (
            self.offload_activations and self.disk_dir is not None
        ):
            raise ValueError(
                "swap.disk_acts puts offloaded unit inputs on the NVMe tier: it needs "
                "swap.offload_activations: true and swap.disk_dir set (or disk_acts: none)"
            )
        if self.disk_weights.strip() not in ("", "none") and self.disk_dir is None:
            raise ValueError(
                "swap.disk_weights puts units' compute copies on the NVMe tier: it needs "
                "swap.disk_dir set (or disk_weights: none)"
            )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)  # peers: listen and/or join

    def n_units(self) -> int:
        """Embedding unit + block units + head unit."""
        lpu = self.swap.layers_per_unit
        return 2 + (self.model.n_layer + lpu - 1) // lpu

    def validate(self) -> Config:
        """Checks that span sections; returns self for chaining."""
        if self.swap.layers_per_unit > self.model.n_layer:
            raise ValueError(
                f"swap.layers_per_unit ({self.swap.layers_per_unit}) exceeds model.n_layer "
                f"({self.model.n_layer})"
            )
        if self.swap.resident_units > self.n_units() - 2:
            raise ValueError(
                f"swap.resident_units ({self.swap.resident_units}) is more than the block units "
                f"({self.n_units() - 2}); lower it"
            )
        if self.swap.prefetch > self.n_units() - 1:
            raise ValueError(
                f"swap.prefetch ({self.swap.prefetch}) is larger than the number of units "
                f"after the first ({self.n_units() - 1}); lower it"
            )
        if self.swap.disk_dir is not None and self.gossip.enabled:
            raise ValueError(
                "swap.disk_dir (the NVMe tier) does not train with peers yet; drop "
                "--listen/--join or swap.disk_dir"
            )
        if self.swap.card_update.strip() not in ("", "none") and self.train.optimizer != "adamw":
            raise ValueError(
                "swap.card_update runs torch's AdamW on the device: set train.optimizer=adamw, "
                "or swap.card_update=none"
            )
        if self.swap.disk_dir is not None and self.train.optimizer == "deepspeed":
            raise ValueError("swap.disk_dir works with train.optimizer=adamw, not deepspeed")
        if self.swap.state != "fp32" and self.train.optimizer == "deepspeed":
            raise ValueError(
                f"swap.state={self.swap.state} runs its own 8-bit AdamW; use "
                "train.optimizer=adamw with it (or swap.state=fp32 for DeepSpeedCPUAdam)"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        if not isinstance(data, dict):
            raise ConfigError("config must be a mapping of sections (model:, train:, swap:)")
        sections = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in data.items():
            if key not in sections:
                raise ConfigError(f"unknown config section {key!r}{_suggest(key, sections)}")
            kwargs[key] = _build_section(sections[key].default_factory, key, value or {})
        try:
            return cls(**kwargs).validate()
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _suggest(name: str, options, section: str = "") -> str:
    """The closest of `options`, named whole ("'train.lr'", as --set takes it)."""
    close = difflib.get_close_matches(name, list(options), n=1)
    prefix = f"{section}." if section else ""
    return f"; did you mean {prefix + close[0]!r}?" if close else f"; valid: {', '.join(options)}"


def _key_of_any_section(key: str, section: str | None = None) -> str:
    """'train.lr' for a key `lr` given without its section (or under a misspelt one):
    the sections holding a key of that name (or the closest one), "" when none is close."""
    defaults = Config()
    sections = [f.name for f in fields(Config)]
    if section is not None:  # a misspelt section: look in the sections it resembles
        sections = difflib.get_close_matches(section, sections, n=2) or sections
    exact = [s for s in sections if key in {f.name for f in fields(getattr(defaults, s))}]
    if exact:
        return " or ".join(repr(f"{s}.{key}") for s in exact)
    for s in sections:
        close = difflib.get_close_matches(key, [f.name for f in fields(getattr(defaults, s))], n=1)
        if close:
            return repr(f"{s}.{close[0]}")
    return ""


def _type_ok(value: Any, hint: Any) -> bool:
    """Check a YAML value against a field's annotation (int, float, bool, str, X | None;
    a Literal is checked with its words: choices.py)."""
    if choices_of(hint) is not None:
        return True  # the section's own check names the words (check_choices)
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return True
        if option is bool and isinstance(value, bool):
            return True
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if option is str and isinstance(value, str):
            return True
    return False


def _build_section(factory, section: str, values: dict[str, Any]):
    if not isinstance(values, dict):
        raise ConfigError(f"config section {section!r} must be a mapping")
    known = {f.name: f for f in fields(factory)}
    hints = typing.get_type_hints(factory)
    values = dict(values)
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key {section}.{key}{_suggest(key, known, section)}")
        if isinstance(value, str) and float in typing.get_args(hints[key]) + (hints[key],):
            # YAML 1.1 reads 3e-4 (no dot) as a string; accept it as the number it is
            try:
                value = values[key] = float(value)
            except ValueError:
                pass
        if hints[key] is str and isinstance(value, int) and not isinstance(value, bool):
            # a word that YAML read as a number: swap.card_update=5 names unit 5
            value = values[key] = str(value)
        if not _type_ok(value, hints[key]):
            expected = str(hints[key]).replace("<class '", "").replace("'>", "")
            raise ConfigError(f"{section}.{key} must be {expected}, got {value!r}")
    values = {k: float(v) if hints[k] is float else v for k, v in values.items()}
    try:
        return factory(**values)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _parse_value(text: str) -> Any:
    """YAML scalars, so --set train.lr=3e-4 and --set swap.checkpoint=false type themselves."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _takes_only_str(section: Any, key: str) -> bool:
    return typing.get_type_hints(type(section))[key] is str


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings to a raw config mapping (before validation)."""
    defaults = Config()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) != 2:
            whole = _key_of_any_section(parts[-1]) if len(parts) == 1 else ""
            hint = f"; did you mean {whole}?" if whole else ""
            raise ConfigError(f"--set key must look like section.key, got {path!r}{hint}")
        section, key = parts
        if not hasattr(defaults, section) or section.startswith("_"):
            sections = [f.name for f in fields(Config)]
            whole = _key_of_any_section(key, section)
            hint = f"; did you mean {whole}?" if whole else _suggest(section, sections)
            raise ConfigError(f"unknown --set section {section!r}{hint}")
        names = [f.name for f in fields(getattr(defaults, section))]
        if key not in names:
            raise ConfigError(f"unknown --set key {section}.{key}{_suggest(key, names, section)}")
        data.setdefault(section, {})
        if data[section] is None:
            data[section] = {}
        value = _parse_value(raw)
        if value is None and not raw.strip() and _takes_only_str(getattr(defaults, section), key):
            value = ""  # `--set gossip.join=`: the empty string, not YAML's null
        data[section][key] = value
    return data


def config_names() -> list[str]:
    """The names --config takes: the files in configs/ (the list the CLI and docs give)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A path, or the name of a file in configs/ (with or without .yaml)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.exists():
            return candidate
    raise ConfigError(
        f"config file not found: {name_or_path} (give a path or one of: "
        f"{', '.join(config_names())})"
    )


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file (or a name in configs/) as a mapping of sections."""
    file = resolve_config_path(str(path))
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{file} is not valid YAML{where}; fix the syntax") from None
    except OSError as err:
        raise ConfigError(f"cannot read config {file}: {err.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must be a mapping of sections (model:, train:, swap:)")
    return data


def names_hf_model(section: Any) -> bool:
    """`model: hf:PATH`, or a model mapping with init_from: a Hugging Face checkpoint whose
    config.json fills the section (atom.run.run_config expands it, above this floor)."""
    return isinstance(section, str) or (
        isinstance(section, dict) and bool(section.get("init_from"))
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """A config from a file (or configs/ name) and --set overrides. One that names a Hugging
    Face model is refused here: atom.run.run_config.load_run_config reads that checkpoint."""
    data = read_config_file(path) if path is not None else {}
    if names_hf_model(data.get("model")):
        raise ConfigError(
            f"{path} names a Hugging Face model; load it with atom.run.run_config.load_run_config "
            "(as atom train and atom profile do)"
        )
    return Config.from_dict(apply_overrides(data, overrides or []))


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of cfg with some fields changed, e.g. replace(cfg, swap={"prefetch": 2})."""
    data = cfg.to_dict()
    for section, values in sections.items():
        data[section].update(values)
    return Config.from_dict(data)


__all__ = [
    "Config",
    "ConfigError",
    "GossipConfig",
    "ModelConfig",
    "SwapConfig",
    "TrainConfig",
    "apply_overrides",
    "config_names",
    "names_hf_model",
    "read_config_file",
    "load_config",
    "replace",
]


def model_differences(saved: Any, cfg: Config, where: str = "saved") -> str:
    """ "" when `saved` (a model section as a plan or checkpoint stored it) is the model of
    `cfg`, else the keys that differ ("model.n_layer 24 saved, 32 here; ..."). Keys added to
    ModelConfig since it was stored take their defaults."""
    now = cfg.to_dict()["model"]
    if not isinstance(saved, dict):
        return f"no model section {where}"
    saved = {**ModelConfig().__dict__, **saved}
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    return "; ".join(f"model.{k} {saved.get(k)!r} {where}, {now.get(k)!r} here"
                     for k in differ[:3])  # fmt: skip
