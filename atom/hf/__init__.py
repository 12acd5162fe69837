"""Hugging Face checkpoints in and out: LLaMA-family (llama, mistral, qwen2) and GPT-2.

In (:mod:`atom.hf.source`): ``model: hf:PATH`` (or ``atom train --model PATH``) reads
PATH/config.json, maps it onto an atom :class:`ModelConfig` (``init_from`` keeps PATH), checks
every tensor's name, shape and dtype against the model from the safetensors headers alone,
and after the engine has allocated its host buffers copies the weights in one tensor at a
time, so the host never holds more than the model plus one tensor.

Out (:mod:`atom.hf.export`): ``atom export RUN_DIR --hf OUT`` writes config.json, safetensors
shards with an index and the tokenizer files, in the source checkpoint's dtype (or the one
asked for).

Text (:mod:`atom.text.records`, re-exported here): JSONL records (text, instruction, chat) for
``atom prepare`` and the tokenizer of a checkpoint directory.

transformers is never imported; nothing touches the network. Import from here
(``from atom.hf import export_hf``); the submodules are an internal layout.
"""

from __future__ import annotations

from atom.ground.device import DTYPES
from atom.hf.export import ExportSummary, export_hf
from atom.hf.source import (
    DEFAULT_MAX_SEQ,
    FAMILIES,
    PREFIX,
    HFSource,
    Mapped,
    check_config,
    checkpoint_name,
    expand_model_section,
    load_weights,
    model_bytes,
    name_map,
)
from atom.text.records import (
    TOKENIZER_FILES,
    eos_token_id,
    jsonl_chunks,
    record_text,
    tokenizer_file,
)

__all__ = [
    "DEFAULT_MAX_SEQ",
    "DTYPES",
    "FAMILIES",
    "PREFIX",
    "TOKENIZER_FILES",
    "ExportSummary",
    "HFSource",
    "Mapped",
    "check_config",
    "checkpoint_name",
    "eos_token_id",
    "expand_model_section",
    "export_hf",
    "jsonl_chunks",
    "load_weights",
    "model_bytes",
    "name_map",
    "record_text",
    "tokenizer_file",
]
