"""Writing a training run as a Hugging Face model directory (``atom export RUN --hf OUT``).

config.json (the source checkpoint's, with what training may have changed written back, or
a fresh one for a model trained from scratch), safetensors shards of at most
``max_shard_size`` with an index, and the tokenizer files, in the source checkpoint's dtype
or the one asked for. The directory is built beside OUT and moved into place at the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atom.config import Config, ConfigError, ModelConfig
from atom.ground.device import DTYPES
from atom.ground.sizes import parse_bytes
from atom.hf.source import _HF_DTYPES, HFSource, name_map
from atom.text.records import TOKENIZER_FILES

log = logging.getLogger(__name__)


def _fresh_config(mc: ModelConfig, family: str, dtype: str) -> dict[str, Any]:
    """config.json for a model atom trained from scratch."""
    hf_dtype = {v: k for k, v in _HF_DTYPES.items()}[dtype]
    if family == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": mc.d_model,
            "n_layer": mc.n_layer,
            "n_head": mc.n_head,
            "n_inner": mc.ffn_dim,
            "n_positions": mc.seq_len,
            "vocab_size": mc.vocab_size,
            "layer_norm_epsilon": mc.norm_eps,
            "activation_function": "gelu_new" if mc.gelu == "tanh" else "gelu",
            "tie_word_embeddings": mc.tied,
            "scale_attn_weights": True,
            "torch_dtype": hf_dtype,
        }
    arch = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
        family, "LlamaForCausalLM"
    )
    window = (
        {"sliding_window": mc.sliding_window, "use_sliding_window": True, "max_window_layers": 0}
        if mc.sliding_window
        else {"use_sliding_window": False}
    )
    return {
        "architectures": [arch],
        "model_type": family,
        "hidden_size": mc.d_model,
        "intermediate_size": mc.ffn_dim,
        "num_hidden_layers": mc.n_layer,
        "num_attention_heads": mc.n_head,
        "num_key_value_heads": mc.kv_heads,
        "head_dim": mc.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": mc.seq_len,
        "rms_norm_eps": mc.norm_eps,
        "rope_theta": mc.rope_theta,
        **_rope_scaling(mc),
        "tie_word_embeddings": mc.tied,
        "vocab_size": mc.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        **window,
        "torch_dtype": hf_dtype,
    }


def _rope_scaling(mc: ModelConfig) -> dict[str, Any]:
    """config.json's rope_scaling for a model trained with scaled RoPE (none otherwise)."""
    if mc.rope_type == "default":
        return {}
    scaling: dict[str, Any] = {"rope_type": mc.rope_type, "factor": mc.rope_factor}
    if mc.rope_type == "llama3":
        scaling.update(
            low_freq_factor=mc.rope_low_freq_factor,
            high_freq_factor=mc.rope_high_freq_factor,
            original_max_position_embeddings=mc.rope_original_max_position,
        )
    if mc.rope_type == "yarn":
        scaling.update(
            original_max_position_embeddings=mc.rope_original_max_position,
            beta_fast=mc.rope_beta_fast,
            beta_slow=mc.rope_beta_slow,
            truncate=mc.rope_truncate,
        )
        if mc.rope_attention_factor is not None:
            scaling["attention_factor"] = mc.rope_attention_factor
    return {"rope_scaling": scaling}


def _export_config(src: HFSource, mc: ModelConfig, dtype: str) -> dict[str, Any]:
    """The source config.json with what training may have changed written back."""
    c = json.loads(json.dumps(src.config))
    hf_dtype = {v: k for k, v in _HF_DTYPES.items()}[dtype]
    if "torch_dtype" in c or "dtype" not in c:
        c["torch_dtype"] = hf_dtype
    if "dtype" in c:
        c["dtype"] = hf_dtype
    if src.family == "gpt2":
        c["layer_norm_epsilon"] = mc.norm_eps
        if src.model_section["gelu"] != mc.gelu:
            c["activation_function"] = "gelu_new" if mc.gelu == "tanh" else "gelu"
    else:
        c["rms_norm_eps"] = mc.norm_eps
        scaling = _rope_scaling(mc).get("rope_scaling", {})
        if isinstance(c.get("rope_parameters"), dict):  # transformers >= 5
            c["rope_parameters"] = {
                "rope_type": mc.rope_type, "rope_theta": mc.rope_theta, **scaling
            }  # fmt: skip
            c["rope_parameters"].pop("type", None)
        else:
            c["rope_theta"] = mc.rope_theta
            c.pop("rope_scaling", None)
            if scaling:
                c["rope_scaling"] = scaling
    return c


def _family_of(mc: ModelConfig) -> str:
    if mc.arch == "gpt":
        return "gpt2"
    if mc.qkv_bias:
        return "qwen2"
    return "mistral" if mc.sliding_window else "llama"  # LlamaConfig has no sliding window


@dataclass
class ExportSummary:
    out: Path
    step: int
    family: str
    dtype: str
    shards: int
    bytes: int
    tokenizer_files: list[str]


def export_hf(
    run: Path,
    out: Path,
    dtype: str = "source",
    max_shard_size: str | int = "5GB",
) -> ExportSummary:
    """Write the newest valid checkpoint under `run` as a Hugging Face model directory."""
    from safetensors.torch import save_file

    from atom.store.checkpoint import CheckpointError, load_checkpoint

    limit = parse_bytes(max_shard_size, "--max-shard-size")  # "5GB" = 5 * 10**9, as transformers
    if limit < 1:
        raise ConfigError("--max-shard-size must be positive")
    if dtype != "source" and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be source, fp32, bf16 or fp16, got {dtype!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; export into a new directory")
    ckpt = load_checkpoint(Path(run))
    cfg = Config.from_dict(ckpt.meta["config"])
    mc = cfg.model
    src = None
    if mc.init_from:
        if Path(mc.init_from).is_dir():
            src = HFSource(mc.init_from)
        else:
            log.warning("source checkpoint %s is gone: writing a fresh config.json", mc.init_from)
    family = src.family if src else _family_of(mc)
    if dtype == "source":
        dtype = src.dtype if src else "fp32"
    hf_config = _export_config(src, mc, dtype) if src else _fresh_config(mc, family, dtype)
    torch_dtype = DTYPES[dtype]

    names = set(ckpt.names())
    mapping = name_map(mc)
    missing = [n for n in mapping if n not in names]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks {missing[0]}; it is not this model")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, m in mapping.items():
            t = ckpt.get(name)
            if m.op == "T":
                t = t.t()
            elif m.op == "rows" and src is not None:
                key = src._resolve(m.hf_name)
                full = src.read(key).to(torch.float32).clone() if key else None
                if full is not None and full.shape[0] > t.shape[0]:
                    full[: t.shape[0]] = t  # untrained positions keep the source's rows
                    t = full
                del full
            yield m.hf_name, t.to(torch_dtype).contiguous()
        if family == "gpt2" and not mc.bias:  # GPT-2 always has biases: zeros are exact
            for i in range(mc.n_layer):
                for part, width in (
                    ("ln_1", mc.d_model),
                    ("ln_2", mc.d_model),
                    ("attn.c_attn", 3 * mc.d_model),
                    ("attn.c_proj", mc.d_model),
                    ("mlp.c_fc", mc.ffn_dim),
                    ("mlp.c_proj", mc.d_model),
                ):
                    yield f"transformer.h.{i}.{part}.bias", torch.zeros(width, dtype=torch_dtype)
            yield "transformer.ln_f.bias", torch.zeros(mc.d_model, dtype=torch_dtype)

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shards: list[tuple[Path, list[str]]] = []
        total = 0
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = 0

        def flush() -> None:
            nonlocal pending, pending_bytes
            if pending:
                path = tmp / f"shard-{len(shards):05d}.safetensors"
                save_file(pending, str(path), metadata={"format": "pt"})
                shards.append((path, list(pending)))
            pending, pending_bytes = {}, 0

        for hf_name, t in tensors():
            if pending and pending_bytes + t.nbytes > limit:
                flush()
            pending[hf_name] = t
            pending_bytes += t.nbytes
            total += t.nbytes
        flush()
        weight_map: dict[str, str] = {}
        if len(shards) == 1:
            shards[0][0].rename(tmp / "model.safetensors")
        else:
            for i, (path, keys) in enumerate(shards):
                final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                path.rename(tmp / final)
                weight_map.update({k: final for k in keys})
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        copied = _copy_tokenizer(src, ckpt.meta.get("data", {}).get("tokenizer", "byte"), tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportSummary(out, ckpt.step, family, dtype, len(shards), total, copied)


def _copy_tokenizer(src: HFSource | None, data_tokenizer: str, dest: Path) -> list[str]:
    copied: list[str] = []
    if src is not None:
        for name in TOKENIZER_FILES:
            if (src.path / name).is_file():
                shutil.copy2(src.path / name, dest / name)
                copied.append(name)
    used = Path(data_tokenizer.removeprefix("tokenizers:"))
    if data_tokenizer.startswith("tokenizers:") and used.is_file():
        if "tokenizer.json" not in copied:
            shutil.copy2(used, dest / "tokenizer.json")
            copied.append("tokenizer.json")
        elif used.read_bytes() != (dest / "tokenizer.json").read_bytes():
            log.warning("training data used %s, not the checkpoint's tokenizer.json", used)
    elif "tokenizer.json" not in copied:
        log.warning(
            "no tokenizer.json to export (data tokenizer %s); token ids are UTF-8 bytes",
            data_tokenizer,
        )
    return copied
