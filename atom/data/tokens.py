"""Token datasets: prepare text into memory-mapped token shards and sample batches from them.

A prepared dataset is a directory holding ``train.bin`` and ``val.bin`` (raw numpy token arrays,
read back with ``np.memmap``) plus ``meta.json`` (a :class:`DatasetMeta`). ``meta.json`` is
written last, so its presence is what marks a directory as complete.

A dataset of records (JSONL: chat, instructions, prompt/completion) is a dataset of
*documents*: ``train.flags``/``val.flags`` hold one byte per token, LEARN (the model learns to
write it: an assistant turn, a completion; a prompt's tokens only are read) and START (a
document begins). Its windows start where a document starts (anywhere inside one longer than
a window), are packed with the documents that follow, and carry the positions within each
document so the model keeps them apart (atom.model.documents); targets not to learn are
IGNORE. Plain text is one stream: random windows, every token learned, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from atom.ground.errors import DataError  # noqa: F401  (re-exported: callers import it from here too)
from atom.model.documents import IGNORE, positions_in_documents
from atom.text.records import jsonl_chunks
from atom.text.tokenize import (  # noqa: F401  (file_blocks, text_pieces: re-exported)
    TextEncoder,
    byte_tokenizer,
    file_blocks,
    load_tokenizer,
    text_pieces,
    token_dtype,
)

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")  # .jsonl: one record per line (atom/hf/)
META_NAME = "meta.json"
TRAIN_NAME = "train.bin"
VAL_NAME = "val.bin"
FLAGS_SUFFIX = ".flags"  # train.flags / val.flags beside the .bin of a dataset of documents
LEARN, START = 1, 2  # flag bits
# Second entropy word of the RNG seed: keeps train and val streams disjoint for the same seed.
_TRAIN_STREAM, _VAL_STREAM = 0, 1


@dataclass
class DatasetMeta:
    vocab_size: int
    tokenizer: str
    dtype: str
    train_tokens: int
    val_tokens: int
    source: str
    documents: bool = False  # records with per-token flags (datasets before it: plain text)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DatasetMeta:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"meta.json is not valid JSON ({e}); re-run atom prepare") from e
        if not isinstance(raw, dict):
            raise DataError("meta.json does not hold a JSON object; re-run atom prepare")
        required = [f for f in fields(cls) if f.default is MISSING]
        missing = [f.name for f in required if f.name not in raw]
        if missing:
            raise DataError(f"meta.json lacks {', '.join(missing)}; re-run atom prepare")
        # Unknown keys are ignored so that a newer atom's datasets stay readable.
        meta = cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})
        if meta.dtype not in ("uint8", "uint16", "uint32"):
            raise DataError(f"meta.json has unsupported dtype {meta.dtype!r}; re-run atom prepare")
        return meta


def check_vocab(meta: DatasetMeta, vocab_size: int, data_dir: Path | str | None = None) -> None:
    """Fail early when the dataset holds token ids the model's embedding cannot index."""
    if meta.vocab_size > vocab_size:
        where = f"dataset {data_dir}" if data_dir is not None else "the dataset"
        raise DataError(
            f"{where} uses a vocabulary of {meta.vocab_size} tokens but model.vocab_size is "
            f"{vocab_size}; set --set model.vocab_size={meta.vocab_size} or prepare with a "
            "matching tokenizer"
        )


def _head(path: Path, n: int = 8192) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _is_records(path: Path) -> bool:
    """JSONL records, one a line: .jsonl, or recognised by content (a .json of records)."""
    if path.suffix == ".jsonl":
        return True
    return path.suffix not in TEXT_SUFFIXES and b"\0" not in _head(path) and _looks_like_jsonl(path)


def _looks_like_jsonl(path: Path, most: int = 1 << 24) -> bool:
    """JSON Lines whatever the file is called (a .json file of records, say): the first
    non-empty line (up to 16 MiB) is a whole JSON object."""
    with open(path, "rb") as f:
        for line in iter(lambda: f.readline(most), b""):
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except ValueError:
                    return False
    return False


def _collect_files(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for inp in inputs:
        inp = Path(inp)
        if inp.is_file():
            files.append(inp)
        elif inp.is_dir():
            # Sort by relative path so the token stream is identical on every machine.
            found = [p for p in inp.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()]
            if not found:
                logger.warning("%s holds no %s files", inp, "/".join(TEXT_SUFFIXES))
            files.extend(sorted(found, key=lambda p: p.relative_to(inp).as_posix()))
        else:
            raise DataError(f"input {inp} does not exist; pass existing text files or directories")
    return files


def _document_cut(flags_path: Path, n_train: int, total: int) -> int:
    """Where val begins in a dataset of documents: the document start nearest the planned
    cut (either side; never the very first token), so no document is split between the
    two; the planned cut where there is no other start (one long document)."""
    flags = np.memmap(flags_path, dtype=np.uint8, mode="r", shape=(total,))
    block = 1 << 24
    after = before = None
    for at in range(n_train, total, block):  # the first start at or after the cut
        hits = np.flatnonzero(flags[at : min(at + block, total)] & START)
        if len(hits):
            after = at + int(hits[0])
            break
    for end in range(n_train, 1, -block):  # the last start before it (after token 0)
        lo = max(1, end - block)
        hits = np.flatnonzero(flags[lo:end] & START)
        if len(hits):
            before = lo + int(hits[-1])
            break
    candidates = [c for c in (after, before) if c is not None]
    return min(candidates, key=lambda c: abs(c - n_train)) if candidates else n_train


def _write_dataset(
    chunks: Iterable,
    out_dir: Path,
    tok: TextEncoder,
    val_fraction: float,
    source: str,
    documents: bool = False,
) -> DatasetMeta:
    """Stream token chunks to disk, split off the tail as val, and publish atomically.
    `documents`: chunks are (ids, flags) pairs, and the flags are written beside."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {out_dir} exists and is not a directory; choose another path")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Drop an older meta.json first: replacing the .bin files under it would otherwise leave a
    # directory that looks complete but mixes two runs if we are killed half-way.
    (out_dir / META_NAME).unlink(missing_ok=True)

    dtype = token_dtype(tok.vocab_size)
    # Unique temp names, so concurrent prepares into one directory cannot corrupt each other.
    flag_names = [n.replace(".bin", FLAGS_SUFFIX) for n in (TRAIN_NAME, VAL_NAME)]
    names = [TRAIN_NAME, VAL_NAME, META_NAME] + (flag_names if documents else [])
    for name in flag_names:
        if not documents:  # an older dataset of documents in the same place
            (out_dir / name).unlink(missing_ok=True)
    tmp: dict[str, Path] = {}
    for name in names:
        fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        # mkstemp makes the file private (0600); a dataset is meant to be shared like any file.
        os.chmod(tmp_name, 0o644)
        tmp[name] = Path(tmp_name)
    try:
        total = 0
        # Everything goes to the train files first; the val tail is moved out once the
        # total is known, which avoids holding the corpus in memory.
        with open(tmp[TRAIN_NAME], "r+b") as f_train, ExitStack() as stack:
            f_flags = stack.enter_context(open(tmp[flag_names[0]], "r+b")) if documents else None
            for chunk in chunks:
                ids, flags = chunk if documents else (chunk, None)
                f_train.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
                if f_flags is not None:
                    f_flags.write(np.ascontiguousarray(flags, dtype=np.uint8).tobytes())
                total += len(ids)
            if total == 0:
                raise DataError("the corpus is empty; pass files or directories that hold text")
            if total < 2:
                raise DataError(f"the corpus has only {total} token; pass more text")
            # Both splits get at least one token so that neither file is empty.
            n_val = min(max(round(total * val_fraction), 1), total - 1)
            n_train = total - n_val
            if f_flags is not None:
                f_flags.flush()
                n_train = _document_cut(tmp[flag_names[0]], n_train, total)
                n_val = total - n_train
                _split_tail(f_flags, tmp[flag_names[1]], n_train, 1)
            _split_tail(f_train, tmp[VAL_NAME], n_train, dtype.itemsize)
        meta = DatasetMeta(tok.vocab_size, tok.name, dtype.name, n_train, n_val, source, documents)
        tmp[META_NAME].write_text(meta.to_json())
        for name in names:  # meta.json last: it marks the directory complete
            os.replace(tmp[name], out_dir / name)
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return meta


def _documents(tokens: Iterator[tuple[Path, object]], records: set[Path]) -> Iterator[tuple]:
    """(ids, flags) per chunk: every record a document (learned as its flags say), every
    text file one document, all learned."""
    started: set[Path] = set()
    for path, chunk in tokens:
        if path in records:
            ids, learn = chunk
            flags = learn & LEARN
        else:
            ids, flags = chunk, np.full(len(chunk), LEARN, dtype=np.uint8)
        if len(ids) and path not in started:
            flags[0] |= START
            if path not in records:
                started.add(path)  # a text file's later blocks continue its document
        yield ids, flags


def _split_tail(f_all, val_path: Path, n_train: int, itemsize: int) -> None:
    """Move what follows the first n_train items of f_all into val_path, both synced."""
    with open(val_path, "wb") as f_val:
        f_all.seek(n_train * itemsize)
        shutil.copyfileobj(f_all, f_val)
        f_val.flush()
        os.fsync(f_val.fileno())
    f_all.truncate(n_train * itemsize)
    f_all.flush()
    os.fsync(f_all.fileno())


def prepare(
    inputs: list[Path],
    out_dir: Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.1,
    progress: bool = True,
    source: str | None = None,
    learn_prompts: bool = False,
) -> DatasetMeta:
    """Tokenize text files/directories into ``out_dir``; the last ``val_fraction`` is val.
    With JSONL records among them it is a dataset of documents (see the module doc);
    `learn_prompts` learns the prompts' tokens too."""
    tok = load_tokenizer(tokenizer)
    files = _collect_files([Path(p) for p in inputs])
    if not files:
        raise DataError("the corpus is empty: no text files found; pass files or directories")
    if source is None:
        source = f"{len(files)} file(s) from " + ", ".join(str(Path(p)) for p in inputs)
    records = {p for p in files if _is_records(p)}

    def tokens() -> Iterator[tuple[Path, object]]:
        for path in tqdm(files, desc="tokenizing", unit="file", disable=not progress):
            head = _head(path)
            if b"\0" in head:
                raise DataError(
                    f"{path} is binary (it holds NUL bytes), not UTF-8 text; pass text files "
                    "(convert UTF-16 to UTF-8), or "
                    f"directories (from which only {'/'.join(TEXT_SUFFIXES)} files are read)"
                )
            if path in records:
                for chunk in jsonl_chunks(path, tok, learn_prompts):
                    yield path, chunk
                continue
            for block in file_blocks(path):
                yield path, tok.encode(block, path)

    chunks = _documents(tokens(), records) if records else (chunk for _, chunk in tokens())
    meta = _write_dataset(chunks, Path(out_dir), tok, val_fraction, source, bool(records))
    logger.debug(
        "prepared %s: %d train + %d val tokens", out_dir, meta.train_tokens, meta.val_tokens
    )
    return meta


def _stdlib_sources(stdlib: Path) -> list[Path]:
    files: list[Path] = []
    for root, dirs, names in os.walk(stdlib):
        # Installed third-party packages are not ours to copy and vary between machines.
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files.extend(Path(root) / n for n in names if n.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def default_corpus(cache_dir: Path | None = None, max_bytes: int = 8_000_000) -> Path:
    """Byte-level dataset built from this Python's standard library sources; cached."""
    if max_bytes <= 0:
        raise DataError(f"max_bytes must be positive, got {max_bytes}")
    if cache_dir is None:
        cache_dir = Path(os.environ.get("ATOM_CACHE") or Path.home() / ".cache" / "atom")
    cache_dir = Path(cache_dir).expanduser()
    major, minor = sys.version_info[:2]
    final = cache_dir / f"stdlib-py{major}{minor}-{max_bytes}"
    if (final / META_NAME).is_file():
        return final

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_sources(stdlib) if stdlib.is_dir() else []
    if not files:
        raise DataError(
            f"no Python standard library sources found at {stdlib}; "
            "prepare a dataset with atom prepare and pass it instead"
        )
    logger.info("preparing default corpus (%d bytes of %s/*.py) in %s", max_bytes, stdlib, final)

    def chunks() -> Iterator[np.ndarray]:
        left = max_bytes
        for path in files:
            if left <= 0:
                return
            data = path.read_bytes()[:left]
            left -= len(data)
            yield np.frombuffer(data, dtype=np.uint8)

    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build in a private directory and rename it into place: several trainers on one machine
    # may race here, and a rename publishes the whole dataset at once or not at all.
    tmp_dir = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{final.name}."))
    os.chmod(tmp_dir, 0o755)  # mkdtemp makes it private; the published cache should not be
    try:
        source = (
            f"Python {major}.{minor} standard library *.py sources ({stdlib}), "
            f"first {max_bytes} bytes"
        )
        _write_dataset(chunks(), tmp_dir, byte_tokenizer(), 0.1, source)
        if final.exists() and not (final / META_NAME).is_file():
            logger.warning("removing incomplete cached dataset %s", final)
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp_dir, final)
        except OSError:
            if not (final / META_NAME).is_file():
                raise
            # Another process published the same dataset first; theirs is identical.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final


def _check_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    """Every id below the dataset's vocabulary, checked before the first step (an id out
    of range is an IndexError in the embedding many steps in). Skipped when the dtype
    cannot hold one; otherwise a streaming max, ~GB/s."""
    if np.iinfo(tokens.dtype).max < vocab_size:
        return
    chunk = 1 << 26
    for start in range(0, len(tokens), chunk):
        top = int(tokens[start : start + chunk].max())
        if top >= vocab_size:
            raise DataError(
                f"{path} holds token id {top}, outside the dataset's vocabulary of "
                f"{vocab_size} (a corrupt or foreign shard); re-run atom prepare"
            )


def _check_size(path: Path, expected: int, why: str) -> None:
    actual = path.stat().st_size if path.is_file() else None
    if actual != expected:
        found = "is missing" if actual is None else f"has {actual} bytes"
        raise DataError(f"{path} {found} but {why} (truncated or corrupt); re-run atom prepare")


@dataclass
class _DocumentIndex:
    """A split's flags and where its documents start."""

    flags: np.memmap
    starts: np.ndarray  # token index of each document start, ascending

    def window_starts(self, drawn: np.ndarray, T: int) -> np.ndarray:
        """A window drawn at token p starts where p's document starts when the document is
        shorter than the window (then the documents after it fill the rest), and at p
        inside a longer one: every token is drawn with the same chance, and a short
        document is always read whole from its start."""
        n = len(self.flags)
        if not len(self.starts):  # the split lies inside one document: plain windows
            return np.minimum(drawn, n - T - 1)
        k = np.searchsorted(self.starts, drawn, side="right") - 1
        begin = np.where(k >= 0, self.starts[np.maximum(k, 0)], 0)
        ends = np.append(self.starts, n)
        end = ends[np.minimum(k + 1, len(self.starts))]
        chosen = np.where(end - begin <= T + 1, begin, drawn)
        return np.minimum(chosen, n - T - 1)


def peer_seed(seed: int, name: str) -> int:
    """A peer's own seed, from the run's and the peer's name: peers of one group draw
    different batches (identical peers averaging each other waste the group), and a
    peer restarted under its name draws its own again. 63 bits: torch.manual_seed too."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TokenData:
    """Random-window batches over a prepared dataset, reproducible from (seed, step, micro)."""

    def __init__(self, data_dir: Path, seq_len: int, seed: int) -> None:
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        # SeedSequence takes non-negative entropy only; folding keeps any int seed usable.
        self.seed = seed % (1 << 64)
        self.order_seed = self.seed  # the training windows' (reorder: a peer's own)
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        if self.data_dir.is_file():
            raise DataError(
                f"train.data {self.data_dir} is a file; training reads a directory made by "
                f"atom prepare: atom prepare {self.data_dir} --out DIR, then train.data=DIR"
            )
        if not self.data_dir.is_dir():
            raise DataError(
                f"dataset directory {self.data_dir} does not exist; create it with atom prepare"
            )
        meta_path = self.data_dir / META_NAME
        if not meta_path.is_file():
            raise DataError(
                f"{meta_path} is missing (not a prepared dataset, or prepare was interrupted); "
                "re-run atom prepare"
            )
        try:
            self.meta = DatasetMeta.from_json(meta_path.read_text())
        except DataError as e:
            raise DataError(f"{self.data_dir}: {e}") from e
        except (TypeError, ValueError, OSError) as e:
            raise DataError(f"cannot read {meta_path} ({e}); re-run atom prepare") from e
        dtype = np.dtype(self.meta.dtype)
        self._train = self._open(TRAIN_NAME, self.meta.train_tokens, dtype)
        self._val = self._open(VAL_NAME, self.meta.val_tokens, dtype)
        for name, tokens in ((TRAIN_NAME, self._train), (VAL_NAME, self._val)):
            _check_ids(tokens, self.meta.vocab_size, self.data_dir / name)
        self._docs: dict[int, _DocumentIndex] = {}
        if self.meta.documents:
            for name, tokens in ((TRAIN_NAME, self._train), (VAL_NAME, self._val)):
                self._docs[id(tokens)] = self._open_flags(name, len(tokens))

    def _open_flags(self, name: str, n_tokens: int) -> _DocumentIndex:
        path = self.data_dir / name.replace(".bin", FLAGS_SUFFIX)
        _check_size(path, n_tokens, f"the dataset has {n_tokens} tokens")
        flags = np.memmap(path, dtype=np.uint8, mode="r")
        block, starts, learned = 1 << 26, [], False  # in blocks: no split-sized temporaries
        for i in range(0, n_tokens, block):
            part = flags[i : i + block]
            learned = learned or bool((part & LEARN).any())
            starts.append(np.flatnonzero(part & START) + i)
        if not learned:
            raise DataError(
                f"{path}: no token of the {name.removesuffix('.bin')} split is to be learned "
                "(records with prompts and no answers); add assistant turns or completions, "
                "or prepare with --learn-prompts"
            )
        return _DocumentIndex(flags, np.concatenate(starts) if starts else np.zeros(0, np.int64))

    def _open(self, name: str, n_tokens: int, dtype: np.dtype) -> np.memmap:
        path = self.data_dir / name
        expected = n_tokens * dtype.itemsize
        _check_size(path, expected, f"meta.json expects {expected} bytes")
        split = name.removesuffix(".bin")
        if n_tokens < 2:  # a window needs an input and its next token
            fix = "a larger --val-fraction" if split == "val" else "a smaller --val-fraction"
            raise DataError(
                f"the {split} split of {self.data_dir} has {n_tokens} token(s); a window "
                f"needs 2: use more text, or re-run atom prepare with {fix}"
            )
        if n_tokens < self.seq_len + 1:  # a small dataset (a documented example) still runs
            logger.warning(
                "the %s split of %s has %d tokens, fewer than seq_len+1=%d: its windows are "
                "%d tokens long (add text to train on the full context)",
                split, self.data_dir, n_tokens, self.seq_len + 1, n_tokens - 1,
            )  # fmt: skip
        return np.memmap(path, dtype=dtype, mode="r")

    def _windows(self, tokens: np.memmap, rng: np.random.Generator, batch_size: int) -> tuple:
        """(x, y), or for a dataset of documents (x, y, positions within the documents);
        windows are seq_len tokens, or the whole split less one where it is shorter."""
        T = min(self.seq_len, len(tokens) - 1)
        # Highest valid start is len - T - 1 so that y's last token exists; high is exclusive.
        starts = rng.integers(0, len(tokens) - T, size=batch_size)
        docs = self._docs.get(id(tokens))
        if docs is not None:
            starts = docs.window_starts(starts, T)
        at = starts[:, None] + np.arange(T + 1)
        buf = tokens[at].astype(np.int64)
        x = torch.from_numpy(np.ascontiguousarray(buf[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(buf[:, 1:]))
        if docs is None:
            return x, y
        flags = torch.from_numpy(docs.flags[at].astype(np.int64))
        begins = (flags & START) != 0
        # a target is learned when flagged so, and not the first token of the next document
        learned = ((flags & LEARN) != 0) & ~begins
        y = y.masked_fill(~learned[:, 1:], IGNORE)
        return x, y, positions_in_documents(begins)[:, :-1].contiguous()

    def train_batch(self, step: int, micro: int, batch_size: int) -> tuple:
        """(x, y) int64 of shape (batch_size, seq_len), and the positions within documents
        for a dataset of documents; a pure function of (seed, step, micro)."""
        if step < 0 or micro < 0:
            raise ValueError(f"step and micro must be non-negative, got {step}, {micro}")
        rng = np.random.default_rng([self.order_seed, _TRAIN_STREAM, step, micro])
        return self._windows(self._train, rng, batch_size)

    def reorder(self, seed: int) -> None:
        """Training windows drawn from `seed` (a peer's own order); the val batches stay
        train.seed's, so that every peer measures on the same windows."""
        self.order_seed = seed % (1 << 64)

    def val_batches(self, n_batches: int, batch_size: int) -> list[tuple]:
        """A fixed set of val batches; batch k depends only on (seed, k), so sets nest."""
        return [
            self._windows(self._val, np.random.default_rng([self.seed, _VAL_STREAM, k]), batch_size)
            for k in range(n_batches)
        ]
