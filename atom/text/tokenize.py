"""Tokenizers for `atom prepare`: bytes (vocabulary 256) or a Hugging Face tokenizer.json,
and the cutting of a corpus of any size into pieces whose tokens are those of the whole."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atom.ground.errors import DataError
from atom.text.records import eos_token_id, tokenizer_file

logger = logging.getLogger(__name__)

_TOKENIZERS_PREFIX = "tokenizers:"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id of a vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


@dataclass
class TextEncoder:
    name: str  # canonical form stored in meta.json
    vocab_size: int
    encode: Callable[[bytes, Path], np.ndarray]
    eos: int | None = None  # appended after each JSONL record
    # (text, learn) pieces -> (ids, LEARN flag per token); the tokens of the whole text
    encode_pieces: Callable[[list, Path], tuple[np.ndarray, np.ndarray]] | None = None


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


def byte_tokenizer() -> TextEncoder:
    def encode_pieces(pieces, _path):
        data = [(text.encode("utf-8"), flag) for text, flag in pieces]
        learn = [np.full(len(d), flag, dtype=np.uint8) for d, flag in data]
        ids = np.frombuffer(b"".join(d for d, _ in data), dtype=np.uint8)
        return ids, np.concatenate(learn) if learn else np.zeros(0, np.uint8)

    return TextEncoder(
        "byte", 256, lambda data, _path: np.frombuffer(data, dtype=np.uint8), None, encode_pieces
    )


def load_tokenizer(spec: str) -> TextEncoder:
    if spec == "byte":
        return byte_tokenizer()
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

    def encode_pieces(pieces, src: Path):
        """The whole record in one encode (tokens across a prompt/answer boundary are those
        of the whole text), each token learned when any of its characters is: byte-level
        BPE folds the space before an answer into its first token ("Ġ" + "Paris"), and
        that token is the answer's; a record over ~1 MB piece by piece."""
        text = "".join(t for t, _ in pieces)
        if len(text) > PIECE_CHARS:
            parts = [(encode(t.encode("utf-8"), src), flag) for t, flag in pieces]
            learn = [np.full(len(ids), flag, dtype=np.uint8) for ids, flag in parts]
            return np.concatenate([ids for ids, _ in parts]), np.concatenate(learn)
        chars = np.concatenate([np.full(len(t), flag, dtype=np.int64) for t, flag in pieces])
        learned_before = np.concatenate([[0], np.cumsum(chars)])  # learned chars before i
        enc = tok.encode(text, add_special_tokens=False)
        span = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2).clip(0, len(text))
        end = np.maximum(span[:, 1], np.minimum(span[:, 0] + 1, len(text)))  # >= 1 char
        learn = (learned_before[end] - learned_before[span[:, 0]]) > 0
        return np.asarray(enc.ids, dtype=dtype), learn.astype(np.uint8)

    return TextEncoder(
        f"{_TOKENIZERS_PREFIX}{path}", vocab, encode, eos_token_id(path, tok), encode_pieces
    )


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
