"""Small tokenizers and scripted models for tests: trained or written here, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def byte_level_bpe(texts: list[str], specials: list[str], vocab_size: int = 300):
    """A byte-level BPE tokenizer (GPT-2's layout) trained on `texts`."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, directory: Path, config: dict) -> Path:
    """A checkpoint-style tokenizer directory: tokenizer.json + tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def script_generation(monkeypatch, script: list[int], vocab: int) -> list[list[int]]:
    """Make atom.commands.generate's model write `script`, one token a step; the list returned
    fills with what the model was given at each step."""
    import atom.commands.generate as gen

    seen: list[list[int]] = []

    def scripted(model, idx, T, cache):
        seen.append(idx[0].tolist())
        logits = torch.full((1, vocab), -1e9)
        logits[0, script[len(seen) - 1]] = 0.0
        return logits

    monkeypatch.setattr(gen, "_next_logits", scripted)
    return seen
