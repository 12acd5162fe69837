"""Token datasets: prepare text into memory-mapped token shards and sample batches from them.

A prepared dataset is a directory holding ``train.bin`` and ``val.bin`` (raw numpy token arrays,
read back with ``np.memmap``) plus ``meta.json`` (a :class:`DatasetMeta`). ``meta.json`` is
written last, so its presence is what marks a directory as complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from atom.errors import DataError  # noqa: F401  (re-exported: callers import it from here too)
from atom.text import eos_token_id, jsonl_chunks, tokenizer_file

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")  # .jsonl: one record per line (atom/hf/)
META_NAME = "meta.json"
TRAIN_NAME = "train.bin"
VAL_NAME = "val.bin"
_TOKENIZERS_PREFIX = "tokenizers:"
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
        missing = [f.name for f in fields(cls) if f.name not in raw]
        if missing:
            raise DataError(f"meta.json lacks {', '.join(missing)}; re-run atom prepare")
        # Unknown keys are ignored so that a newer atom's datasets stay readable.
        meta = cls(**{f.name: raw[f.name] for f in fields(cls)})
        if meta.dtype not in ("uint8", "uint16", "uint32"):
            raise DataError(f"meta.json has unsupported dtype {meta.dtype!r}; re-run atom prepare")
        return meta


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id of a vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def check_vocab(meta: DatasetMeta, vocab_size: int, data_dir: Path | str | None = None) -> None:
    """Fail early when the dataset holds token ids the model's embedding cannot index."""
    if meta.vocab_size > vocab_size:
        where = f"dataset {data_dir}" if data_dir is not None else "the dataset"
        raise DataError(
            f"{where} uses a vocabulary of {meta.vocab_size} tokens but model.vocab_size is "
            f"{vocab_size}; set --set model.vocab_size={meta.vocab_size} or prepare with a "
            "matching tokenizer"
        )


@dataclass
class _Tokenizer:
    name: str  # canonical form stored in meta.json
    vocab_size: int
    encode: Callable[[bytes, Path], np.ndarray]
    eos: int | None = None  # appended after each JSONL record


PIECE_CHARS = 1 << 20


def _single_space(text, i: int) -> bool:
    """A lone space between two non-space characters (text may be str or bytes)."""
    space = " " if isinstance(text, str) else 32
    return text[i] == space and not _is_space(text[i - 1]) and not _is_space(text[i + 1])


def _is_space(c) -> bool:
    return c.isspace() if isinstance(c, str) else c in _SPACE


def text_pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters, each cut just before a lone space that
    starts a word ("a word" -> "a" + " word"): where BPE pre-tokenizers put a boundary
    anyway (GPT-2's byte-level, tiktoken-style, SentencePiece's metaspace), so encoding the
    pieces one by one gives the tokens of the whole (tested for byte-level BPE). Runs of
    whitespace and newlines are never cut. A text with no such place in a piece's second
    half is cut at its end."""
    start, n = 0, len(text)
    while n - start > size:
        end = start + size
        cut = end
        while cut > start + size // 2 and not _single_space(text, cut - 1):
            cut -= 1
        if cut == start + size // 2:  # no word boundary in the second half: cut anyway
            cut = end
        else:
            cut -= 1  # before the whitespace, which belongs to the next word
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:]


def _byte_tokenizer() -> _Tokenizer:
    return _Tokenizer("byte", 256, lambda data, _path: np.frombuffer(data, dtype=np.uint8))


def _load_tokenizer(spec: str) -> _Tokenizer:
    if spec == "byte":
        return _byte_tokenizer()
    if Path(spec).expanduser().is_dir():  # a Hugging Face checkpoint directory
        spec = str(tokenizer_file(Path(spec).expanduser()))
    if spec.startswith(_TOKENIZERS_PREFIX):
        path_str = spec[len(_TOKENIZERS_PREFIX) :]
    elif spec.endswith(".json"):
        path_str = spec  # a bare tokenizer.json path is unambiguous, so accept it
    else:
        raise DataError(
            f"unknown tokenizer {spec!r}; use 'byte' or 'tokenizers:/path/to/tokenizer.json'"
        )
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist; pass the path to a tokenizer.json")
    try:
        # Imported lazily: it is an optional extra and byte-level training never needs it.
        from tokenizers import Tokenizer
    except ImportError as e:
        raise DataError(
            "the 'tokenizers' package is not installed; pip install 'atom[tokenizers]' "
            "or use --tokenizer byte"
        ) from e
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception on malformed files
        raise DataError(
            f"could not load tokenizer {path} ({e}); pass a valid tokenizer.json"
        ) from e
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)

    def encode(data: bytes, src: Path) -> np.ndarray:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            logger.warning("%s is not valid UTF-8; undecodable bytes become U+FFFD", src)
            text = data.decode("utf-8", errors="replace")
        # One encode call per piece of ~1 MB: a whole file in one call (a 30 MB line, say)
        # makes the tokenizer's working memory grow out of bounds.
        ids = [tok.encode(piece, add_special_tokens=False).ids for piece in text_pieces(text)]
        return np.asarray([i for part in ids for i in part], dtype=dtype)

    return _Tokenizer(f"{_TOKENIZERS_PREFIX}{path}", vocab, encode, eos_token_id(path, tok))


BLOCK_BYTES = 1 << 22
_SPACE = b" \t\n\r\x0b\x0c"


def file_blocks(path: Path, size: int | None = None) -> Iterator[bytes]:
    """A file in blocks of about `size` bytes, so a corpus of any size is tokenized in
    bounded memory. Each block ends just before a lone space that starts a word (as
    text_pieces cuts text: the tokens are those of the whole file), or, with no such place
    in the block's second half, at a UTF-8 character boundary."""
    size = size or BLOCK_BYTES
    data = b""
    with open(path, "rb") as f:
        while chunk := f.read(size):
            data += chunk
            while len(data) > size:
                cut = _word_cut(data, size)
                yield data[:cut]
                data = data[cut:]
    if data:
        yield data


def _word_cut(data: bytes, size: int) -> int:
    for i in range(size - 1, size // 2, -1):
        if _single_space(data, i):
            return i  # before the space, which belongs to the next word
    cut = size
    while cut > size // 2 and 0x80 <= data[cut] < 0xC0:  # not inside a UTF-8 character
        cut -= 1
    return cut


def _head(path: Path, n: int = 8192) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


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


def _write_dataset(
    chunks: Iterable[np.ndarray],
    out_dir: Path,
    tok: _Tokenizer,
    val_fraction: float,
    source: str,
) -> DatasetMeta:
    """Stream token chunks to disk, split off the tail as val, and publish atomically."""
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
    tmp: dict[str, Path] = {}
    for name in (TRAIN_NAME, VAL_NAME, META_NAME):
        fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        # mkstemp makes the file private (0600); a dataset is meant to be shared like any file.
        os.chmod(tmp_name, 0o644)
        tmp[name] = Path(tmp_name)
    try:
        total = 0
        with open(tmp[TRAIN_NAME], "r+b") as f_train:
            # Everything goes to the train file first; the val tail is moved out once the
            # total is known, which avoids holding the corpus in memory.
            for chunk in chunks:
                f_train.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                total += len(chunk)
            if total == 0:
                raise DataError("the corpus is empty; pass files or directories that hold text")
            if total < 2:
                raise DataError(f"the corpus has only {total} token; pass more text")
            # Both splits get at least one token so that neither file is empty.
            n_val = min(max(round(total * val_fraction), 1), total - 1)
            n_train = total - n_val
            with open(tmp[VAL_NAME], "wb") as f_val:
                f_train.seek(n_train * dtype.itemsize)
                shutil.copyfileobj(f_train, f_val)
                f_val.flush()
                os.fsync(f_val.fileno())
            f_train.truncate(n_train * dtype.itemsize)
            f_train.flush()
            os.fsync(f_train.fileno())
        meta = DatasetMeta(tok.vocab_size, tok.name, dtype.name, n_train, n_val, source)
        tmp[META_NAME].write_text(meta.to_json())
        os.replace(tmp[TRAIN_NAME], out_dir / TRAIN_NAME)
        os.replace(tmp[VAL_NAME], out_dir / VAL_NAME)
        os.replace(tmp[META_NAME], out_dir / META_NAME)  # last: marks the directory complete
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return meta


def prepare(
    inputs: list[Path],
    out_dir: Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.1,
    progress: bool = True,
    source: str | None = None,
) -> DatasetMeta:
    """Tokenize text files/directories into ``out_dir``; the last ``val_fraction`` is val."""
    tok = _load_tokenizer(tokenizer)
    files = _collect_files([Path(p) for p in inputs])
    if not files:
        raise DataError("the corpus is empty: no text files found; pass files or directories")
    if source is None:
        source = f"{len(files)} file(s) from " + ", ".join(str(Path(p)) for p in inputs)

    def chunks() -> Iterator[np.ndarray]:
        for path in tqdm(files, desc="tokenizing", unit="file", disable=not progress):
            head = _head(path)
            if b"\0" in head:
                raise DataError(
                    f"{path} is binary (it holds NUL bytes), not UTF-8 text; pass text files "
                    "(convert UTF-16 to UTF-8), or "
                    f"directories (from which only {'/'.join(TEXT_SUFFIXES)} files are read)"
                )
            # records, one a line: .jsonl, or recognised by content (a .json file of records)
            if path.suffix == ".jsonl" or (
                path.suffix not in TEXT_SUFFIXES and _looks_like_jsonl(path)
            ):
                yield from jsonl_chunks(path, tok)
                continue
            for block in file_blocks(path):
                yield tok.encode(block, path)

    meta = _write_dataset(chunks(), Path(out_dir), tok, val_fraction, source)
    logger.info(
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
        _write_dataset(chunks(), tmp_dir, _byte_tokenizer(), 0.1, source)
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


class TokenData:
    """Random-window batches over a prepared dataset, reproducible from (seed, step, micro)."""

    def __init__(self, data_dir: Path, seq_len: int, seed: int) -> None:
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        # SeedSequence takes non-negative entropy only; folding keeps any int seed usable.
        self.seed = seed % (1 << 64)
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

    def _open(self, name: str, n_tokens: int, dtype: np.dtype) -> np.memmap:
        path = self.data_dir / name
        expected = n_tokens * dtype.itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise DataError(
                f"{path} {found} but meta.json expects {expected} bytes (truncated or corrupt); "
                "re-run atom prepare"
            )
        split = name.removesuffix(".bin")
        if n_tokens < self.seq_len + 1:
            raise DataError(
                f"the {split} split of {self.data_dir} has {n_tokens} tokens, fewer than "
                f"seq_len+1={self.seq_len + 1}; use more text, a larger val_fraction, "
                "or a smaller seq_len"
            )
        return np.memmap(path, dtype=dtype, mode="r")

    def _windows(
        self, tokens: np.memmap, rng: np.random.Generator, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        # Highest valid start is len - T - 1 so that y's last token exists; high is exclusive.
        starts = rng.integers(0, len(tokens) - T, size=batch_size)
        buf = tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64)
        x = torch.from_numpy(np.ascontiguousarray(buf[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(buf[:, 1:]))
        return x, y

    def train_batch(
        self, step: int, micro: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 of shape (batch_size, seq_len); a pure function of (seed, step, micro)."""
        if step < 0 or micro < 0:
            raise ValueError(f"step and micro must be non-negative, got {step}, {micro}")
        rng = np.random.default_rng([self.seed, _TRAIN_STREAM, step, micro])
        return self._windows(self._train, rng, batch_size)

    def val_batches(
        self, n_batches: int, batch_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of val batches; batch k depends only on (seed, k), so sets nest."""
        return [
            self._windows(self._val, np.random.default_rng([self.seed, _VAL_STREAM, k]), batch_size)
            for k in range(n_batches)
        ]
