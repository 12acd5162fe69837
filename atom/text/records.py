"""Text for training and fine-tuning: a checkpoint directory's tokenizer, and JSONL records.

Below both atom.data.tokens (which prepares datasets with it) and atom.hf (which exports the
tokenizer files), so neither reaches into the other.

``atom prepare --tokenizer DIR`` reads DIR/tokenizer.json; records of ``.jsonl`` files
(``{"text"}``, chat ``{"messages"}`` through the checkpoint's chat template, Alpaca
instruction/output, prompt/completion) become token arrays, each ended by the tokenizer's
end-of-text token, with a flag per token saying whether the model learns to write it (the
assistant's turns, the output, the completion) or only reads it (the prompt).
transformers is never imported; nothing touches the network.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from atom.ground.errors import DataError

log = logging.getLogger(__name__)

# The tokenizer files of a checkpoint directory (atom export copies those present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def tokenizer_file(directory: Path) -> Path:
    """A checkpoint directory's tokenizer.json (for `atom prepare --tokenizer DIR`)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        hint = ""
        if (path.parent / "tokenizer.model").is_file():
            hint = " (it has tokenizer.model: load it with transformers and save_pretrained)"
        raise DataError(
            f"{directory} has no tokenizer.json{hint}; atom prepare reads Hugging Face "
            "tokenizers in tokenizer.json form"
        )
    return path


def tokenizer_json(spec: str) -> Path | None:
    """The tokenizer.json a run's tokenizer spec names ("tokenizers:PATH"), or None (bytes)."""
    return Path(spec.removeprefix("tokenizers:")) if spec.startswith("tokenizers:") else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_config(tokenizer_json: Path) -> dict[str, Any]:
    path = tokenizer_json.parent / "tokenizer_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_id(tokenizer_json: Path, tok) -> int | None:
    """End-of-text id separating JSONL records: tokenizer_config.json's eos_token, else
    config.json's eos_token_id, else a conventional token present in the vocabulary."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    text = _token_text(_tokenizer_config(tokenizer_json).get("eos_token"))
    if text is not None and tok.token_to_id(text) is not None:
        return tok.token_to_id(text)
    try:
        eos = json.loads((tokenizer_json.parent / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        eos = None
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if isinstance(eos, int) and 0 <= eos < vocab:
        return eos
    for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"):
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return None


def _chat_template(tokenizer_json: Path | None):
    """The checkpoint's Jinja chat template, compiled: render(messages,
    add_generation_prompt=False) -> str; or None."""
    if tokenizer_json is None:
        return None
    cfg = _tokenizer_config(tokenizer_json)
    source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = tokenizer_json.parent / "chat_template.jinja"
    if not isinstance(source, str) and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not isinstance(source, str):
        return None
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("jinja2 is not installed: chat records use a plain ChatML layout")
        return None

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    template = env.from_string(source)
    specials = {
        "bos_token": _token_text(cfg.get("bos_token")) or "",
        "eos_token": _token_text(cfg.get("eos_token")) or "",
    }
    return lambda messages, add_generation_prompt=False: template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **specials
    )


def chat_template(tokenizer_json: Path | None):
    """render(messages, add_generation_prompt) for a run's tokenizer: the checkpoint's own
    template, else ChatML."""
    return _chat_template(tokenizer_json) or chatml


def chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# A record as (text, learn) pieces: the model is trained to write the pieces with learn
# True (an assistant's turns, a completion, an output) and only reads the others.
Pieces = list[tuple[str, bool]]


def _chat_pieces(messages: list[dict], render) -> Pieces:
    """Each assistant turn is what the template adds between the conversation so far with
    the generation prompt and the conversation including that turn: its content and the
    end-of-turn marker the model must learn to write. A template that does not render a
    turn as such a suffix (one that rewrites earlier turns) falls back to the content."""
    full = render(messages)
    pieces: Pieces = []
    at = 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = render(messages[:k], add_generation_prompt=True)
            upto = render(messages[: k + 1])
        except Exception:  # a template that refuses a partial conversation
            before = upto = ""
        if at <= len(before) and upto.startswith(before) and full.startswith(upto) and upto:
            begin, end = len(before), len(upto)
        else:
            begin = full.find(m["content"], at)
            if begin < 0:
                raise ValueError(
                    f"has an assistant turn ({k + 1}) the chat template does not render "
                    "verbatim; fix the template or the record"
                )
            end = begin + len(m["content"])
        pieces += [(full[at:begin], False), (full[begin:end], True)]
        at = end
    pieces.append((full[at:], False))
    return [p for p in pieces if p[0]]


def record_pieces(record: Any, chat=None) -> Pieces:
    """One JSONL record as training text, in pieces. Accepted: {"text"} (all learned),
    {"messages": [{"role", "content"}]} (through the checkpoint's chat template when it has
    one, ChatML otherwise; the assistant turns learned), Alpaca {"instruction", "input"?,
    "output"} and {"prompt", "completion"|"response"} (the output or completion learned)."""
    if not isinstance(record, dict):
        raise ValueError("is not a JSON object")
    if isinstance(record.get("text"), str):
        return [(record["text"], True)]
    messages = record.get("messages")
    if isinstance(messages, list):
        ok = all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok or not messages:
            raise ValueError('has "messages" that are not a list of {"role", "content"} strings')
        return _chat_pieces(messages, chat or chatml)
    if isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
        extra = record.get("input")
        prompt = f"### Instruction:\n{record['instruction']}\n\n"
        if isinstance(extra, str) and extra:
            prompt += f"### Input:\n{extra}\n\n"
        return [(prompt + "### Response:\n", False), (record["output"], True)]
    answer = record.get("completion", record.get("response"))
    if isinstance(record.get("prompt"), str) and isinstance(answer, str):
        return [(record["prompt"], False), (answer, True)]
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise ValueError(
        f'has no "text", "messages", "instruction"/"output" or "prompt"/"completion" '
        f"field (keys: {keys})"
    )


def record_text(record: Any, chat=None) -> str:
    """One JSONL record as training text (see record_pieces)."""
    return "".join(text for text, _ in record_pieces(record, chat))


def jsonl_chunks(path: Path, tok, learn_prompts: bool = False) -> Iterator:
    """(token ids, learn flags) for the records of one JSONL file, each record followed by
    the tokenizer's end-of-text token (or a blank line where there is none), which is
    learned: the model learns where an answer stops. `learn_prompts`: learn every token."""
    import numpy as np

    path_json = tokenizer_json(tok.name)
    chat = _chat_template(path_json)
    eos = getattr(tok, "eos", None)
    eos_text = _token_text(_tokenizer_config(path_json).get("eos_token")) if path_json else None
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                pieces = record_pieces(json.loads(line), chat)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno} is not valid JSON ({e.msg}); fix the line"
                ) from None
            except ValueError as e:
                raise DataError(f"{path}:{lineno} {e}") from None
            if learn_prompts:
                pieces = [(text, True) for text, _ in pieces]
            # the end is learned with the answer it ends: after a record with nothing to
            # learn (a chat with no assistant turn) it would teach stopping after a prompt
            answered = any(flag and text for text, flag in pieces)
            if eos is None:
                pieces.append(("\n\n", answered))
            ids, learn = tok.encode_pieces(pieces, path)
            if eos is not None and not (eos_text and pieces and pieces[-1][0].endswith(eos_text)):
                ids = np.concatenate([ids, np.asarray([eos], dtype=ids.dtype)])
                learn = np.concatenate([learn, np.full(1, answered, dtype=learn.dtype)])
            yield ids, learn
