"""Reading a local Hugging Face checkpoint: LLaMA-family (llama, mistral, qwen2) and GPT-2.

``model: hf:PATH`` (or ``atom train --model PATH``) reads PATH/config.json and maps it onto
an atom :class:`ModelConfig` (``init_from`` keeps PATH), refusing what atom's models cannot
represent (scaled RoPE, quantized weights, biases they lack, seq_len past a sliding window).
:class:`HFSource` checks every tensor's name, shape and dtype against the model from the
safetensors headers alone; after the engine has allocated its host buffers,
:func:`load_weights` copies the weights in one tensor at a time: each read opens the shard,
takes a memory-mapped view of that one tensor, and closes it once the engine has cast it
into its fp32 master, so the host never holds more than the model plus one tensor.

Also here: the atom <-> Hugging Face parameter name table (:func:`name_map`, shared with
the export) and the hooks atom.config and atom.run.train call (:func:`expand_model_section`,
:func:`check_config`, :func:`load_weights`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atom.config import Config, ConfigError, ModelConfig
from atom.ground.errors import DataError

log = logging.getLogger(__name__)

PREFIX = "hf:"
FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
DEFAULT_MAX_SEQ = 2048  # default seq_len when the checkpoint allows longer: memory grows with T
_HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_ST_DTYPES = ("F32", "F16", "BF16", "F64")
# Keys that fix the shape of the weights: they must agree with the checkpoint.
_SHAPE_KEYS = (
    "arch",
    "n_layer",
    "n_head",
    "n_kv_head",
    "d_model",
    "d_ff",
    "vocab_size",
    "bias",
    "qkv_bias",
    "tie_embeddings",
)
# Tensors in some checkpoints that are buffers, not parameters.
_IGNORABLE = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")


# --------------------------------------------------------------------------- name mapping

# (atom name pattern, HF name template, op) in the HF layout save_pretrained writes.
# ops: "" copy as is; "T" transpose (GPT-2's Conv1D stores (in, out)); "rows" leading rows
# (GPT-2 position table, when atom trains a shorter context than n_positions).
_LLAMA_RULES = [
    (r"embed\.wte\.weight", "model.embed_tokens.weight", ""),
    (r"blocks\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight", ""),
    (r"blocks\.(\d+)\.attention\.wq\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2", ""),
    (r"blocks\.(\d+)\.attention\.wk\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2", ""),
    (r"blocks\.(\d+)\.attention\.wv\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2", ""),
    (r"blocks\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight", ""),
    (r"blocks\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight", ""),
    (r"blocks\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight", ""),
    (r"blocks\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight", ""),
    (r"blocks\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight", ""),
    (r"head\.norm\.weight", "model.norm.weight", ""),
    (r"head\.lm_head\.weight", "lm_head.weight", ""),
]
_GPT2_RULES = [
    (r"embed\.wte\.weight", "transformer.wte.weight", ""),
    (r"embed\.wpe\.weight", "transformer.wpe.weight", "rows"),
    (r"blocks\.(\d+)\.(ln_1|ln_2)\.(weight|bias)", r"transformer.h.\1.\2.\3", ""),
    (
        r"blocks\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight",
        r"transformer.h.\1.\2.weight",
        "T",
    ),
    (
        r"blocks\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.bias",
        r"transformer.h.\1.\2.bias",
        "",
    ),
    (r"head\.norm\.(weight|bias)", r"transformer.ln_f.\1", ""),
    (r"head\.lm_head\.weight", "lm_head.weight", ""),
]


@dataclass(frozen=True)
class Mapped:
    hf_name: str
    op: str
    shape: tuple[int, ...]  # the atom parameter's shape


def name_map(mc: ModelConfig) -> dict[str, Mapped]:
    """atom parameter name -> HF tensor, for every parameter atom owns (a tied head is the
    embedding, so it does not appear)."""
    from atom.model import build_model

    rules = _GPT2_RULES if mc.arch == "gpt" else _LLAMA_RULES
    out: dict[str, Mapped] = {}
    for name, param in build_model(mc, device="meta").named_parameters():
        for pattern, template, op in rules:
            if re.fullmatch(pattern, name):
                hf = re.sub(pattern, template, name)
                out[name] = Mapped(hf, op, tuple(param.shape))
                break
        else:  # a model change that this table has not caught up with
            raise RuntimeError(f"no Hugging Face name for atom parameter {name}")
    return out


# --------------------------------------------------------------------------- reading


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path} not found; give a Hugging Face checkpoint directory (config.json and "
            "*.safetensors)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path} ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _strip_prefix(spec: str) -> str:
    return spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec


def _yarn(value: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """YaRN's fields, with transformers' defaults (the original context from
    max_position_embeddings, betas 32 and 1, DeepSeek's mscale pair folded into the
    attention factor)."""
    original = value.get("original_max_position_embeddings") or c["max_position_embeddings"]
    factor = float(value["factor"])
    attention = value.get("attention_factor")
    mscale, mscale_all = value.get("mscale"), value.get("mscale_all_dim")
    if attention is None and mscale and mscale_all and factor > 1:
        attention = (0.1 * mscale * math.log(factor) + 1) / (
            0.1 * mscale_all * math.log(factor) + 1
        )
    return {
        "rope_original_max_position": int(original),
        "rope_beta_fast": float(value.get("beta_fast") or 32),
        "rope_beta_slow": float(value.get("beta_slow") or 1),
        "rope_attention_factor": None if attention is None else float(attention),
        "rope_truncate": bool(value.get("truncate", True)),
    }


def _rope(c: dict[str, Any], where: str) -> dict[str, Any]:
    """The model section's RoPE fields: rope_theta, and the frequency scaling if any (plain,
    "linear", or Llama 3.1's "llama3"); the other scalings are refused in one line."""
    params = c.get("rope_parameters")  # transformers >= 5
    scaling = c.get("rope_scaling")  # transformers 4
    out: dict[str, Any] = {"rope_theta": float(c.get("rope_theta", 10000.0))}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict) or any(isinstance(v, dict) for v in value.values()):
            raise ConfigError(
                f"{where}: {key}={value!r} is not supported; atom needs one RoPE for all layers"
            )
        kind = value.get("rope_type", value.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise ConfigError(
                f"{where}: {key} type {kind!r} is not supported (atom implements plain, linear, "
                f"llama3 and yarn RoPE); use a checkpoint without {key}"
            )
        if value.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{where}: {key}.partial_rotary_factor is not supported")
        out["rope_theta"] = float(value.get("rope_theta", out["rope_theta"]))
        if kind == "default":
            continue
        try:
            out.update(rope_type=kind, rope_factor=float(value["factor"]))
            if kind == "llama3":
                out.update(
                    rope_low_freq_factor=float(value["low_freq_factor"]),
                    rope_high_freq_factor=float(value["high_freq_factor"]),
                    rope_original_max_position=int(value["original_max_position_embeddings"]),
                )
            if kind == "yarn":
                out.update(_yarn(value, c))
        except KeyError as err:
            raise ConfigError(f"{where}: {key} ({kind}) lacks {err}") from None
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {key} ({kind}) has a value that is not a number") from None
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{where}: partial_rotary_factor={c['partial_rotary_factor']} is not supported"
        )
    return out


def _refuse_if(cond: bool, where: str, key: str, value: Any, why: str) -> None:
    if cond:
        raise ConfigError(f"{where}: {key}={value!r} is not supported ({why})")


class HFSource:
    """A local Hugging Face checkpoint directory: config.json and safetensors (headers read
    at once, tensors only on demand, one at a time)."""

    def __init__(self, path: str | Path):
        self.path = Path(_strip_prefix(str(path))).expanduser().resolve()
        if not self.path.is_dir():
            raise ConfigError(
                f"Hugging Face checkpoint {self.path} is not a directory; give the local "
                "directory holding config.json and *.safetensors (atom never downloads)"
            )
        self.where = str(self.path / "config.json")
        self.config = _read_json(self.path / "config.json")
        self.family = self.config.get("model_type")
        if self.family not in FAMILIES:
            raise ConfigError(
                f"{self.where}: model_type {self.family!r} is not supported; atom loads "
                f"{', '.join(FAMILIES)} checkpoints"
            )
        if self.config.get("quantization_config"):
            raise ConfigError(
                f"{self.where}: quantized checkpoints (quantization_config) are not supported; "
                "use the full-precision weights"
            )
        self.model_section = self._map_config()
        self._index: dict[str, tuple[Path, tuple[int, ...], str]] | None = None

    # ----------------------------------------------------------------- config
    def _map_config(self) -> dict[str, Any]:
        c, where = self.config, self.where
        self.window: int | None = None
        self.window_everywhere = False  # every layer slides (Mistral): atom's window
        if self.family == "gpt2":
            act = c.get("activation_function", "gelu_new")
            gelu = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}.get(act)
            if act == "gelu":
                gelu = "none"
            _refuse_if(gelu is None, where, "activation_function", act, "gelu_new or gelu only")
            _refuse_if(
                not c.get("scale_attn_weights", True), where, "scale_attn_weights", False, "needed"
            )
            for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
                _refuse_if(bool(c.get(key)), where, key, c.get(key), "not in atom's GPT")
            d = int(c["n_embd"])
            self.n_positions = int(c.get("n_positions", c.get("n_ctx", 1024)))
            return {
                "arch": "gpt",
                "n_layer": int(c["n_layer"]),
                "n_head": int(c["n_head"]),
                "n_kv_head": None,
                "d_model": d,
                "d_ff": int(c.get("n_inner") or 4 * d),
                "vocab_size": int(c["vocab_size"]),
                "seq_len": min(self.n_positions, DEFAULT_MAX_SEQ),
                "bias": True,
                "gelu": gelu,
                "qkv_bias": False,
                "tie_embeddings": bool(c.get("tie_word_embeddings", True)),
                "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
                "init_from": str(self.path),
            }
        # llama, mistral, qwen2
        act = c.get("hidden_act", "silu")
        _refuse_if(act != "silu", where, "hidden_act", act, "SwiGLU with silu only")
        for key in ("attention_bias", "mlp_bias"):
            _refuse_if(bool(c.get(key)), where, key, c.get(key), "no such biases in atom's LLaMA")
        d, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        head_dim = c.get("head_dim")
        _refuse_if(
            head_dim is not None and head_dim != d // heads,
            where,
            "head_dim",
            head_dim,
            f"atom needs hidden_size/num_attention_heads = {d // heads}",
        )
        _refuse_if(d % heads != 0, where, "hidden_size", d, "not divisible by the heads")
        rope = _rope(c, where)
        sliding = c.get("sliding_window")
        every_layer = False  # atom's blocks share one attention: all slide, or none
        if self.family == "mistral" and sliding:
            self.window, every_layer = int(sliding), True
        if self.family == "qwen2" and sliding:
            n = int(c["num_hidden_layers"])
            types = c.get("layer_types") or [
                "sliding_attention"
                if c.get("use_sliding_window") and i >= int(c.get("max_window_layers", 28))
                else "full_attention"
                for i in range(n)
            ]
            if "sliding_attention" in types:
                self.window = int(sliding)
                every_layer = all(t == "sliding_attention" for t in types)
        self.window_everywhere = every_layer
        max_pos = int(c.get("max_position_embeddings", DEFAULT_MAX_SEQ))
        self.n_positions = max_pos
        return {
            "arch": "llama",
            "n_layer": int(c["num_hidden_layers"]),
            "n_head": heads,
            "n_kv_head": int(c.get("num_key_value_heads") or heads),
            "d_model": d,
            "d_ff": int(c["intermediate_size"]),
            "vocab_size": int(c["vocab_size"]),
            # a window only some layers use bounds the context; one they all use does not
            "seq_len": min(
                max_pos, DEFAULT_MAX_SEQ, max_pos if every_layer else self.window or max_pos
            ),
            "sliding_window": self.window if every_layer else None,
            "bias": False,
            "gelu": "none",
            "qkv_bias": self.family == "qwen2",
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            **rope,
            "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
            "init_from": str(self.path),
        }

    @property
    def dtype(self) -> str:
        """The checkpoint's dtype as atom spells it (fp32 when config.json does not say)."""
        name = self.config.get("dtype") or self.config.get("torch_dtype") or "float32"
        return _HF_DTYPES.get(str(name).removeprefix("torch."), "fp32")

    def check(self, mc: ModelConfig) -> None:
        """Refuse a model config that the checkpoint's weights or attention cannot serve."""
        want = self.model_section
        for key in _SHAPE_KEYS:
            have = getattr(mc, key)
            if key == "tie_embeddings":
                have = mc.tied
            if key == "n_kv_head":
                have = mc.kv_heads
            if key == "d_ff":
                have = mc.ffn_dim
            expect = want[key]
            if key == "n_kv_head" and expect is None:
                expect = mc.n_head
            if have != expect:
                raise ConfigError(
                    f"model.{key}={have!r} does not match the checkpoint {self.path} "
                    f"({key}={expect!r}); drop the model.{key} override"
                )
        if mc.arch == "gpt" and mc.seq_len > self.n_positions:
            raise ConfigError(
                f"model.seq_len={mc.seq_len} exceeds the checkpoint's n_positions="
                f"{self.n_positions} (learned positions); use --set model.seq_len="
                f"{self.n_positions} or less"
            )
        if self.window_everywhere and mc.sliding_window != self.window:
            raise ConfigError(
                f"model.sliding_window={mc.sliding_window} differs from the checkpoint's "
                f"sliding_window={self.window}, which its layers were trained with; leave "
                "model.sliding_window as loaded"
            )
        if not self.window_everywhere and mc.sliding_window is not None:
            raise ConfigError(
                "model.sliding_window is set but the checkpoint's attention has no window in "
                "every layer; leave it null"
            )
        if self.window is not None and not self.window_everywhere and mc.seq_len > self.window:
            raise ConfigError(
                f"model.seq_len={mc.seq_len} exceeds the checkpoint's sliding_window="
                f"{self.window}, which only some of its layers use (atom's layers share one "
                f"attention); use --set model.seq_len={self.window} or less"
            )
        if mc.arch == "llama" and mc.seq_len > self.n_positions:
            log.warning(
                "model.seq_len=%d is longer than the checkpoint's max_position_embeddings=%d",
                mc.seq_len,
                self.n_positions,
            )

    # ----------------------------------------------------------------- tensors
    @property
    def index(self) -> dict[str, tuple[Path, tuple[int, ...], str]]:
        """HF tensor name -> (file, shape, safetensors dtype), from the headers only."""
        if self._index is None:
            from safetensors import safe_open

            index_file = self.path / "model.safetensors.index.json"
            if index_file.is_file():
                weight_map = _read_json(index_file).get("weight_map") or {}
                files = sorted({self.path / f for f in weight_map.values()})
            else:
                files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ConfigError(
                    f"{self.path} holds no *.safetensors weights (pytorch_model.bin is not "
                    "read: it is pickle); convert it with transformers' save_pretrained"
                )
            index: dict[str, tuple[Path, tuple[int, ...], str]] = {}
            for file in files:
                try:
                    with safe_open(str(file), framework="pt", device="cpu") as f:
                        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                            sl = f.get_slice(key)
                            index[key] = (file, tuple(sl.get_shape()), sl.get_dtype())
                except Exception as e:  # SafetensorError, OSError: a bad or missing shard
                    raise ConfigError(f"cannot read {file} ({str(e).splitlines()[0]})") from None
            self._index = index
        return self._index

    def _resolve(self, hf_name: str) -> str | None:
        if hf_name in self.index:
            return hf_name
        # original GPT-2 checkpoints name tensors without the "transformer." prefix
        bare = hf_name.removeprefix("transformer.")
        return bare if bare in self.index else None

    def read(self, key: str) -> torch.Tensor:
        """One tensor, memory-mapped: the shard is opened for this read only, so the pages it
        touches leave the process once the caller has copied the tensor and dropped it."""
        from safetensors import safe_open

        file = self.index[key][0]
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    def plan(self, mc: ModelConfig) -> dict[str, tuple[Mapped, str]]:
        """atom name -> (mapping, key in the files); checks presence, shape, dtype, and that no
        weight of the checkpoint is left unused."""
        self.check(mc)
        plan: dict[str, tuple[Mapped, str]] = {}
        for name, m in name_map(mc).items():
            key = self._resolve(m.hf_name)
            if key is None:
                raise ConfigError(
                    f"{self.path} has no tensor {m.hf_name} (needed for {name}); is it a "
                    f"complete {self.family} checkpoint?"
                )
            _, shape, dtype = self.index[key]
            expect = m.shape[::-1] if m.op == "T" else m.shape
            if m.op == "rows":
                ok = len(shape) == 2 and shape[1] == expect[1] and shape[0] >= expect[0]
            else:
                ok = shape == expect
            if not ok:
                raise ConfigError(
                    f"{self.path}: tensor {key} has shape {list(shape)}, but config.json implies "
                    f"{list(expect)}; the checkpoint and its config.json disagree"
                )
            if dtype not in _ST_DTYPES:
                raise ConfigError(
                    f"{self.path}: tensor {key} has dtype {dtype}; atom reads float32, bfloat16 "
                    "and float16 weights"
                )
            plan[name] = (m, key)
        used = {key for _, key in plan.values()}
        extra = [
            k
            for k in self.index
            if k not in used
            and not _IGNORABLE.search(k)
            and not (mc.tied and k.endswith("lm_head.weight"))
        ]
        if extra:
            raise ConfigError(
                f"{self.path} has weights atom's {mc.arch} model has no place for "
                f"({', '.join(sorted(extra)[:3])}{', ...' if len(extra) > 3 else ''}); this "
                "variant is not supported"
            )
        return plan

    def getter(self, mc: ModelConfig) -> Callable[[str], torch.Tensor]:
        plan = self.plan(mc)

        def get(name: str) -> torch.Tensor:
            m, key = plan[name]
            t = self.read(key)
            if m.op == "T":
                t = t.t()
            elif m.op == "rows":
                t = t[: m.shape[0]]
            return t

        return get


# --------------------------------------------------------------------------- config hooks


def expand_model_section(value: Any) -> dict[str, Any]:
    """`model: hf:PATH`, or a mapping with `init_from: PATH` plus keys to override (seq_len),
    -> a full model section read from PATH/config.json."""
    if isinstance(value, str):
        if not value.startswith(PREFIX):
            raise ConfigError(
                f"model: {value!r} is not a mapping; give model settings or hf:PATH to start "
                "from a local Hugging Face checkpoint"
            )
        return dict(HFSource(value).model_section)
    section = dict(HFSource(str(value["init_from"])).model_section)
    section.update({k: v for k, v in value.items() if k != "init_from"})
    return section


def checkpoint_name(init_from: str) -> str:
    """What a fine-tune trains, as its checkpoint names it: 'Qwen2ForCausalLM (qwen2) from
    PATH' (atom runs all three LLaMA-family checkpoints as its llama blocks, and a run's
    first line said "training llama" of a Qwen2). A checkpoint gone since (a resumed run
    keeps its path) is named by its path alone."""
    path = Path(_strip_prefix(init_from)).expanduser()
    try:
        c = json.loads((path / "config.json").read_text(encoding="utf-8"))
        family = c.get("model_type")
        arch = (c.get("architectures") or [family])[0]
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, IndexError):
        return f"the checkpoint at {path}"
    return f"{arch} ({family}) from {path}" if arch != family else f"{family} from {path}"


def check_config(cfg: Config) -> None:
    """The config's model can take the checkpoint's weights (headers only, no tensor read)."""
    HFSource(cfg.model.init_from).plan(cfg.model)


def load_weights(engine, cfg: Config, tokenizer: str | None = None) -> None:
    """Fill an engine's weights from cfg.model.init_from, one tensor at a time."""
    src = HFSource(cfg.model.init_from)
    get = src.getter(cfg.model)
    if tokenizer is not None:
        _check_tokenizer(src, tokenizer)
    started = time.perf_counter()
    with torch.no_grad():
        engine.load_state(get, False, 0)
    log.info(
        "loaded %s weights (%s) from %s in %.1fs",
        src.family,
        src.dtype,
        src.path,
        time.perf_counter() - started,
    )


def _check_tokenizer(src: HFSource, spec: str) -> None:
    own = src.path / "tokenizer.json"
    if spec == "byte":  # byte ids would train as the checkpoint's first 256 tokens: garbage
        raise DataError(
            f"the dataset is byte-level, not tokenized with {src.path}'s tokenizer; prepare "
            f"it with: atom prepare FILES --out DIR --tokenizer {src.path}"
        )
    path = Path(spec.removeprefix("tokenizers:"))
    if own.is_file() and path.is_file() and path.read_bytes() != own.read_bytes():
        raise DataError(
            f"the dataset was tokenized with {path}, which differs from {own} (the "
            f"checkpoint's embeddings expect its own); prepare it with: atom prepare FILES "
            f"--out DIR --tokenizer {src.path}"
        )


def model_bytes(mc: ModelConfig) -> int:
    """fp32 bytes of the model's parameters (what one host copy costs)."""
    from atom.model import build_model, count_parameters

    return 4 * count_parameters(build_model(mc))
