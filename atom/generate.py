"""`atom generate`: sample from a checkpoint with the model held resident (small models)."""

from __future__ import annotations

from pathlib import Path

import torch

from atom.checkpoint import CheckpointError, load_checkpoint
from atom.config import Config
from atom.model import build_model, materialize


def _codec(spec: str):
    if spec.startswith("tokenizers:"):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(spec.split(":", 1)[1])
        return (lambda s: tok.encode(s).ids), (lambda ids: tok.decode(ids))
    return (lambda s: list(s.encode())), (lambda ids: bytes(ids).decode(errors="replace"))


@torch.no_grad()
def generate(
    run: Path, prompt: str, n_tokens: int, temperature: float = 0.8, top_k: int = 50, seed: int = 0
) -> str:
    ckpt = load_checkpoint(run)
    cfg = Config.from_dict(ckpt.meta["config"])
    model = materialize(build_model(cfg.model), seed=0)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in set(ckpt.names())]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks {missing[0]}; it is not a model")
    for name, p in params.items():
        p.copy_(ckpt.get(name))
    encode, decode = _codec(ckpt.meta.get("data", {}).get("tokenizer", "byte"))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([encode(prompt) or [0]], dtype=torch.long)
    for _ in range(n_tokens):
        logits, _ = model(idx[:, -cfg.model.seq_len :])
        logits = logits[:, -1, :] / max(temperature, 1e-5)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt], dim=1)
    return decode(idx[0].tolist())
