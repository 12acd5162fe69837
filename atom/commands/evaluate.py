"""`atom eval`: loss and perplexity of a trained run on held-out text.

The run's newest checkpoint is loaded into the engine it trained with (swapped, so a model
larger than the device evaluates too); the text is a file (tokenized with the run's own
tokenizer) or a dataset directory made by `atom prepare` (its val split, held out by
construction). Every token is scored once: the text is cut into consecutive windows of
seq_len + 1, evaluated a group of batches at a time (unit-major: each unit loaded once per
group).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atom.config import Config
from atom.ground.errors import DataError
from atom.model.documents import IGNORE
from atom.store.checkpoint import load_checkpoint

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int  # tokens scored
    windows: int
    source: str


def _tokens(data: Path, tokenizer: str) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(tokens, their flags for a dataset of documents or None, where they came from)."""
    from atom.data.tokens import (
        FLAGS_SUFFIX,
        META_NAME,
        TRAIN_NAME,
        VAL_NAME,
        DatasetMeta,
        prepare,
    )

    def flags(directory: Path, names: tuple[str, ...], documents: bool):
        if not documents:
            return None
        parts = [np.fromfile(directory / n.replace(".bin", FLAGS_SUFFIX), np.uint8) for n in names]
        return np.concatenate(parts)

    if data.is_dir():
        if not (data / META_NAME).is_file():
            raise DataError(f"{data} is not a dataset made by atom prepare (no meta.json)")
        meta = DatasetMeta.from_json((data / META_NAME).read_text())
        if meta.tokenizer != tokenizer:
            raise DataError(
                f"{data} was tokenized with {meta.tokenizer}, the run with {tokenizer}; "
                "prepare the text with the run's tokenizer, or give a text file"
            )
        val = np.memmap(data / VAL_NAME, dtype=np.dtype(meta.dtype), mode="r")
        split = flags(data, (VAL_NAME,), meta.documents)
        if split is not None and len(split) != len(val):
            raise DataError(f"{data}'s val flags do not match its tokens; re-run atom prepare")
        return np.asarray(val, dtype=np.int64), split, f"the val split of {data}"
    if not data.is_file():
        raise DataError(f"{data} does not exist; give a text file or a prepared dataset directory")
    with tempfile.TemporaryDirectory() as tmp:  # every token of the file, in its order
        meta = prepare([data], Path(tmp), tokenizer=tokenizer, val_fraction=0.5, progress=False)
        names = (TRAIN_NAME, VAL_NAME)
        parts = [np.fromfile(Path(tmp) / n, dtype=np.dtype(meta.dtype)) for n in names]
        all_flags = flags(Path(tmp), names, meta.documents)
    return np.concatenate(parts).astype(np.int64), all_flags, str(data)


def _document_windows(flags: np.ndarray, n: int, T: int, ys: torch.Tensor):
    """Consecutive windows of a dataset of documents: targets not to learn ignored, and
    the positions within each document (restarting at each window's edge too)."""
    from atom.data.tokens import LEARN, START
    from atom.model.documents import IGNORE, positions_in_documents

    f = torch.from_numpy(flags[: n * T + 1].astype(np.int64))
    begins = ((f[:-1] & START) != 0).view(n, T)
    target = f[1:].view(n, T)
    learned = ((target & LEARN) != 0) & ((target & START) == 0)
    return ys.masked_fill(~learned, IGNORE), positions_in_documents(begins)


def evaluate_run(run: Path, data: Path, batch: int | None = None) -> EvalResult:
    from atom.run.train import build_engine

    ckpt = load_checkpoint(run)
    cfg = Config.from_dict(ckpt.meta["config"])
    tokenizer = ckpt.meta.get("data", {}).get("tokenizer", "byte")
    tokens, flags, source = _tokens(Path(data), tokenizer)
    if len(tokens) < 2:
        raise DataError(f"{source} has {len(tokens)} token(s): a window needs 2; use more text")
    T = min(cfg.model.seq_len, len(tokens) - 1)  # a short text is one shorter window
    n = (len(tokens) - 1) // T
    if int(tokens.max()) >= cfg.model.vocab_size:
        raise DataError(f"{source} holds token ids outside the model's vocabulary")
    windows = torch.from_numpy(tokens[: n * T + 1])
    xs = windows[:-1].view(n, T)
    ys = windows[1:].view(n, T)
    size = batch or cfg.train.micro_batch
    if flags is None:
        batches = [(xs[i : i + size], ys[i : i + size]) for i in range(0, n, size)]
    else:  # records: only the answers are scored, each document read alone
        ys, pos = _document_windows(flags, n, T, ys)
        batches = [
            (xs[i : i + size], ys[i : i + size], pos[i : i + size]) for i in range(0, n, size)
        ]
    # each batch weighs what it scores: its tokens, or its learned tokens
    weights = [float((b[1] != IGNORE).sum()) for b in batches]
    scored = int(sum(weights))
    if scored == 0:
        raise DataError(f"{source} has no token to score (no answers in its records)")
    engine = build_engine(cfg)
    try:
        engine.load_state(ckpt.get, False, 0)
        per_group = max(1, cfg.train.eval_batches)
        total = 0.0
        pairs = list(zip(batches, weights, strict=True))
        full = [p for p in pairs if len(p[0][0]) == size]
        groups = [full[i : i + per_group] for i in range(0, len(full), per_group)]
        groups += [[p] for p in pairs if len(p[0][0]) != size]  # a short last batch alone
        for group in groups:
            w = [weight for _, weight in group]
            if sum(w):
                total += engine.evaluate([b for b, _ in group], w) * sum(w)
    finally:
        engine.close()
    loss = total / scored
    return EvalResult(loss, float(np.exp(min(loss, 50.0))), scored, n, source)
