"""`atom generate`: sample from a checkpoint with the model held resident (small models).

With the KV cache (the default) the prompt is run once and each new token costs one
token's forward; without it every token re-runs the whole context. Past the model's
context (seq_len) both see the last seq_len tokens, so the two give the same text (the
cache then restarts from the last seq_len tokens each step). Generation stops at the
tokenizer's end-of-text token when it has one.

`chat`: the prompt is a user's message, laid out by the run's chat template (the
checkpoint's own, ChatML otherwise: the layout `atom prepare` trained on) with the
generation prompt, and the reply stops where the template ends an assistant turn too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from atom.config import Config
from atom.ground.threads import decode_threads
from atom.model import build_model, materialize
from atom.model.kv_cache import KVCache
from atom.store.checkpoint import CheckpointError, load_checkpoint
from atom.text.records import chat_template, tokenizer_json


@dataclass
class Generated:
    text: str  # the prompt (as the model read it) and what followed
    tokens: int  # generated (the end-of-text token, when reached, not counted)
    seconds: float
    stopped_at_eos: bool  # or at the end of the assistant's turn (chat)
    reply: str = ""  # what the model wrote, without the prompt or the end marker
    threads: int = 1  # the CPU threads it ran on

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def end_of_turn(render) -> str:
    """What a chat template writes after an assistant's words to end the turn (ChatML's
    <|im_end|>, Llama 3's <|eot_id|>), found by rendering a short conversation."""
    marker = "\x00reply\x00"
    text = render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
    after = text.split(marker, 1)[1] if marker in text else ""
    return after.strip()


def _codec(spec: str, chat: bool = False):
    """(encode, decode, end-of-text id or None) of a run's tokenizer. `chat`: the template
    writes the special tokens (no second BOS from the tokenizer), and they are decoded as
    text so the end-of-turn marker can be seen."""
    path = tokenizer_json(spec)
    if path is not None:
        from tokenizers import Tokenizer

        from atom.text.records import eos_token_id

        tok = Tokenizer.from_file(str(path))

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=not chat).ids

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=not chat)

        return encode, decode, eos_token_id(path, tok)
    return (lambda s: list(s.encode())), (lambda ids: bytes(ids).decode(errors="replace")), None


def _next_logits(model, idx: torch.Tensor, T: int, cache: KVCache | None) -> torch.Tensor:
    if cache is None:
        return model(idx[:, -T:])[0][:, -1, :]
    if cache.pos == 0 or idx.size(1) > T:  # the prompt, or past the context: from the last T
        cache.reset()
        return model(idx[:, -T:], cache=cache)[0][:, -1, :]
    return model(idx[:, -1:], cache=cache)[0][:, -1, :]


@torch.no_grad()
def generate(
    run: Path,
    prompt: str,
    n_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    use_cache: bool = True,
    chat: bool = False,
    system: str | None = None,
) -> Generated:
    ckpt = load_checkpoint(run)
    cfg = Config.from_dict(ckpt.meta["config"])
    model = materialize(build_model(cfg.model), seed=0)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in set(ckpt.names())]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks {missing[0]}; it is not a model")
    for name, p in params.items():
        p.copy_(ckpt.get(name))
    spec = ckpt.meta.get("data", {}).get("tokenizer", "byte")
    encode, decode, eos = _codec(spec, chat)
    stop = None
    if chat:
        render = chat_template(tokenizer_json(spec))
        messages = [{"role": "system", "content": system}] if system else []
        prompt = render([*messages, {"role": "user", "content": prompt}], True)
        stop = end_of_turn(render) or None
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([encode(prompt) or [0]], dtype=torch.long)
    n_prompt = idx.size(1)
    cache = KVCache(cfg.model.n_layer) if use_cache else None
    started, made, stopped = time.perf_counter(), 0, False
    with decode_threads(cfg.model.d_model) as threads:
        for _ in range(n_tokens):
            logits = _next_logits(model, idx, cfg.model.seq_len, cache) / max(temperature, 1e-5)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            if eos is not None and int(nxt) == eos:
                stopped = True
                break
            idx = torch.cat([idx, nxt], dim=1)
            made += 1
            if stop is not None and stop in decode(idx[0, n_prompt:].tolist()):
                stopped = True
                break
    seconds = time.perf_counter() - started
    reply = decode(idx[0, n_prompt:].tolist())
    if stop is not None:
        reply = reply.split(stop, 1)[0]
    return Generated(decode(idx[0].tolist()), made, seconds, stopped, reply, threads)
