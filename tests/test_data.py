"""Tests for atom.data.tokens (prepare, default_corpus, TokenData).

pytest tests/test_data.py
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from atom.data.tokens import (
    DataError,
    DatasetMeta,
    TokenData,
    check_vocab,
    default_corpus,
    prepare,
    token_dtype,
)

TEXT = "Hello, wörld! ☃ snowman\n" * 40 + "the end — ünïcödé\n"


def read_split(d: Path, name: str, dtype: str) -> np.ndarray:
    return np.memmap(d / name, dtype=dtype, mode="r")


def random_corpus(tmp_path: Path, n: int = 4000, seed: int = 0) -> Path:
    """Random bytes make every window unique, so a batch row pins down its start offset
    (no NUL byte: prepare refuses binary files)."""
    src = tmp_path / "rand.txt"
    src.write_bytes(np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8).tobytes())
    out = tmp_path / "ds"
    prepare([src], out, progress=False)
    return out


def find_start(tokens: np.ndarray, window: np.ndarray) -> int:
    views = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens), len(window))
    hits = np.flatnonzero((views == window).all(axis=1))
    assert len(hits) == 1, f"window found {len(hits)} times"
    return int(hits[0])


def test_prepare_file_roundtrip_and_val_is_tail(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text(TEXT, encoding="utf-8")
    raw = src.read_bytes()
    out = tmp_path / "ds"
    meta = prepare([src], out, val_fraction=0.25, progress=False)

    assert (meta.vocab_size, meta.tokenizer, meta.dtype) == (256, "byte", "uint8")
    assert meta.train_tokens + meta.val_tokens == len(raw)
    assert meta.val_tokens == round(len(raw) * 0.25)
    train = read_split(out, "train.bin", meta.dtype)
    val = read_split(out, "val.bin", meta.dtype)
    assert train.dtype == np.uint8 and len(train) == meta.train_tokens
    assert bytes(train) + bytes(val) == raw
    assert bytes(val) == raw[-meta.val_tokens :]
    # meta.json on disk is what prepare returned, and no temp files were left behind.
    assert DatasetMeta.from_json((out / "meta.json").read_text()) == meta
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_prepare_directory_sorted_and_filtered(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    files = {
        "b/z.py": "print('z')\n",
        "a.md": "# title\n",
        "b/a.txt": "nested ä\n",
        "c.txt": "last\n",
        "skip.bin": "not text",
        "b/skip.json": "{}",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    extra = tmp_path / "extra.txt"
    extra.write_text("explicit file after dir\n")
    out = tmp_path / "ds"
    meta = prepare([root, extra], out, progress=False, source="unit test")

    expected = "".join(files[k] for k in ["a.md", "b/a.txt", "b/z.py", "c.txt"])
    expected += extra.read_text()
    got = bytes(read_split(out, "train.bin", "uint8")) + bytes(read_split(out, "val.bin", "uint8"))
    assert got.decode("utf-8") == expected
    assert meta.source == "unit test"


def test_prepare_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError) as e:
        prepare([missing], tmp_path / "ds", progress=False)
    assert (
        str(e.value) == f"input {missing} does not exist; pass existing text files or directories"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare([empty], tmp_path / "ds", progress=False)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="empty"):
        prepare([tmp_path / "emptydir"], tmp_path / "ds", progress=False)
    ok = tmp_path / "ok.txt"
    ok.write_text(TEXT)
    with pytest.raises(DataError, match="val_fraction"):
        prepare([ok], tmp_path / "ds", val_fraction=1.0, progress=False)
    with pytest.raises(DataError, match="unknown tokenizer"):
        prepare([ok], tmp_path / "ds", tokenizer="gpt2", progress=False)
    with pytest.raises(DataError, match="tok.json does not exist"):
        prepare([ok], tmp_path / "ds", tokenizer=f"tokenizers:{tmp_path}/tok.json")
    assert not (tmp_path / "ds" / "meta.json").exists()


def test_interrupted_prepare_leaves_no_meta(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"{i}.txt").write_text(TEXT)
    out = tmp_path / "ds"
    prepare([tmp_path / "src"], out, progress=False)
    assert (out / "meta.json").exists()

    import atom.data.tokens as data

    real_blocks = data.file_blocks

    def flaky_blocks(path: Path, size=None):
        if path.name == "2.txt":
            raise KeyboardInterrupt  # stands in for a kill part-way through tokenizing
        return real_blocks(path, size)

    monkeypatch.setattr(data, "file_blocks", flaky_blocks)
    with pytest.raises(KeyboardInterrupt):
        prepare([tmp_path / "src"], out, progress=False)
    # The old dataset's meta.json is gone, so the dir no longer claims to be complete,
    # and the temp files were cleaned up.
    assert not (out / "meta.json").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    with pytest.raises(DataError, match="meta.json is missing"):
        TokenData(out, seq_len=8, seed=0)


def test_train_batches_deterministic_and_shifted(tmp_path: Path) -> None:
    out = random_corpus(tmp_path)
    data = TokenData(out, seq_len=16, seed=7)
    x, y = data.train_batch(step=3, micro=1, batch_size=4)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"

    # Same (seed, step, micro) -> same batch, even from a fresh instance (a resumed run).
    x2, y2 = TokenData(out, seq_len=16, seed=7).train_batch(step=3, micro=1, batch_size=4)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # Calling other steps in between does not perturb it: no hidden RNG state.
    data.train_batch(step=99, micro=0, batch_size=4)
    assert torch.equal(data.train_batch(3, 1, 4)[0], x)
    for other in [data.train_batch(4, 1, 4), data.train_batch(3, 0, 4)]:
        assert not torch.equal(other[0], x)
    assert not torch.equal(TokenData(out, seq_len=16, seed=8).train_batch(3, 1, 4)[0], x)

    train = read_split(out, "train.bin", "uint8")
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
        i = find_start(train, row_x)
        assert np.array_equal(row_x, train[i : i + 16])
        assert np.array_equal(row_y, train[i + 1 : i + 17])


def test_val_batches_fixed_and_from_val_split(tmp_path: Path) -> None:
    out = random_corpus(tmp_path)
    data = TokenData(out, seq_len=16, seed=7)
    vb = data.val_batches(n_batches=3, batch_size=2)
    assert len(vb) == 3 and all(x.shape == (2, 16) for x, _ in vb)
    again = TokenData(out, seq_len=16, seed=7).val_batches(5, 2)
    for (x, y), (x2, y2) in zip(vb, again[:3], strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(TokenData(out, seq_len=16, seed=1).val_batches(1, 2)[0][0], vb[0][0])
    val = read_split(out, "val.bin", "uint8")
    for x, y in vb:
        for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
            i = find_start(val, row_x)
            assert np.array_equal(row_y, val[i + 1 : i + 17])


def test_tokendata_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist; create it with atom prepare"):
        TokenData(tmp_path / "missing", seq_len=8, seed=0)
    out = random_corpus(tmp_path, n=200)
    # val split has 20 tokens: enough for seq_len 19, not for 20.
    # Exactly one valid window: every batch must be that window, never reading past the end.
    tight = TokenData(out, seq_len=19, seed=0)
    val = read_split(out, "val.bin", "uint8")
    for x, y in tight.val_batches(8, 4):
        assert (x.numpy() == val[:19]).all() and (y.numpy() == val[1:]).all()
    # shorter than seq_len+1: the split's windows are the whole split (a small example
    # dataset trains as written), and a line says so
    short = TokenData(out, seq_len=64, seed=0)
    for x, y in short.val_batches(2, 3):
        assert x.shape == (3, 19) and (x.numpy() == val[:19]).all() and (y.numpy() == val[1:]).all()
    x, y = short.train_batch(0, 0, 2)
    assert x.shape == (2, 64)  # the train split is long enough for full windows
    train = out / "train.bin"
    train.write_bytes(train.read_bytes()[:-5])
    with pytest.raises(DataError, match=r"train.bin has 175 bytes but meta.json expects 180") as e:
        TokenData(out, seq_len=8, seed=0)
    assert "\n" not in str(e.value) and "re-run atom prepare" in str(e.value)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        TokenData(out, seq_len=8, seed=0)


def test_token_dtype_and_check_vocab() -> None:
    assert [token_dtype(v).name for v in (256, 257, 65536, 65537)] == [
        "uint8",
        "uint16",
        "uint16",
        "uint32",
    ]
    meta = DatasetMeta(50257, "byte", "uint16", 10, 2, "x")
    check_vocab(meta, 50257)
    check_vocab(meta, 60000)
    with pytest.raises(DataError, match=r"set --set model.vocab_size=50257") as e:
        check_vocab(meta, 32000, data_dir="/data/ds")
    assert str(e.value).startswith("dataset /data/ds uses a vocabulary of 50257 tokens")
    assert "model.vocab_size is 32000" in str(e.value)


def test_default_corpus_builds_once(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="atom.data.tokens")
    d = default_corpus(cache_dir=tmp_path, max_bytes=200_000)
    major, minor = sys.version_info[:2]
    assert d == tmp_path / f"stdlib-py{major}{minor}-200000"
    assert sum("default corpus" in r.getMessage() for r in caplog.records) == 1
    data = TokenData(d, seq_len=64, seed=0)
    assert data.meta.train_tokens + data.meta.val_tokens == 200_000
    assert (data.meta.tokenizer, data.meta.dtype) == ("byte", "uint8")
    assert "standard library" in data.meta.source
    text = bytes(read_split(d, "train.bin", "uint8")).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    # Nothing but the published dataset in the cache dir (temp build dir was renamed away).
    assert [p.name for p in tmp_path.iterdir()] == [d.name]

    stamps = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    caplog.clear()
    assert default_corpus(cache_dir=tmp_path, max_bytes=200_000) == d
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == stamps
    assert not [r for r in caplog.records if "default corpus" in r.getMessage()]


def test_default_corpus_uses_atom_cache_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ATOM_CACHE", str(tmp_path / "cache"))
    d = default_corpus(max_bytes=20_000)
    assert d.parent == tmp_path / "cache" and (d / "meta.json").is_file()


def test_tokenizers_bpe(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip(
        "tokenizers", reason="tokenizers not installed (pip install 'atom[tokenizers]')"
    )
    from tokenizers import decoders, models, pre_tokenizers, trainers

    sentences = [
        "the quick brown fox jumps over the lazy dog",
        "the lazy dog sleeps in the sun",
        "a quick brown dog and a quick red fox",
    ] * 5
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(sentences, trainer)
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert 256 < vocab <= 300  # byte alphabet plus some merges: needs uint16 storage

    src = tmp_path / "text.txt"
    text = "\n".join(sentences) + "\n"
    src.write_text(text)
    out = tmp_path / "ds"
    meta = prepare([src], out, tokenizer=f"tokenizers:{tok_path}", progress=False)
    assert meta.vocab_size == vocab and meta.dtype == "uint16"
    assert meta.tokenizer == f"tokenizers:{tok_path.resolve()}"
    ids = np.concatenate(
        [read_split(out, "train.bin", "uint16"), read_split(out, "val.bin", "uint16")]
    )
    assert len(ids) < len(text.encode())  # merges actually compressed the text
    assert tok.decode(ids.tolist()) == text
    data = TokenData(out, seq_len=4, seed=0)
    x, _ = data.train_batch(0, 0, 2)
    assert int(x.max()) < vocab


def test_prepare_refuses_binary_input(tmp_path: Path) -> None:
    elf = tmp_path / "ls"
    elf.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    with pytest.raises(DataError, match="is binary") as e:
        prepare([elf], tmp_path / "ds", progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "ds" / "meta.json").exists()


def test_jsonl_records_are_recognised_by_content(tmp_path: Path) -> None:
    """A .json file holding one JSON object per line is read as records (their text),
    not as raw JSON syntax."""
    records = "".join(json.dumps({"text": f"record number {i}"}) + "\n" for i in range(50))
    as_json, as_jsonl = tmp_path / "a.json", tmp_path / "b.jsonl"
    as_json.write_text(records)
    as_jsonl.write_text(records)
    one = prepare([as_json], tmp_path / "one", progress=False)
    two = prepare([as_jsonl], tmp_path / "two", progress=False)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert b'"text"' not in (tmp_path / "one" / "train.bin").read_bytes()
    assert one.train_tokens == two.train_tokens


def test_a_file_given_as_the_dataset_is_explained(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    with pytest.raises(DataError, match=r"is a file; .*atom prepare .*corpus.txt --out DIR"):
        TokenData(corpus, seq_len=8, seed=0)


def test_token_ids_outside_the_vocabulary_are_refused_at_load(tmp_path: Path) -> None:
    """A shard holding an id >= the dataset's vocabulary (corrupt, or from another
    tokenizer) is refused when opened, not by an IndexError steps into training."""
    out = tmp_path / "ds"
    ids = np.arange(1000, dtype=np.uint16) % 300
    out.mkdir()
    ids[:900].tofile(out / "train.bin")
    ids[900:].tofile(out / "val.bin")
    meta = DatasetMeta(300, "byte", "uint16", 900, 100, "test")
    (out / "meta.json").write_text(meta.to_json())
    TokenData(out, seq_len=8, seed=0)  # all below 300
    bad = ids[:900].copy()
    bad[456] = 4000
    bad.tofile(out / "train.bin")
    with pytest.raises(DataError, match="token id 4000, outside the dataset's vocabulary of 300"):
        TokenData(out, seq_len=8, seed=0)


def test_bpe_encoding_in_pieces_equals_the_whole(tmp_path: Path) -> None:
    """Encoding streams a file in ~1 MB pieces cut before a word (a 30 MB single line in
    one encode call ran out of memory): the tokens are those of encoding it whole."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from atom.data.tokens import text_pieces

    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "über", "lazy", "dog", "42", "—", ","]
    seps = [" ", " ", " ", "  ", "\n", " \n ", "\t"]
    text = "".join(rng.choice(words) + rng.choice(seps) for _ in range(20000))
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [text[:5000]],
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            show_progress=False),
    )  # fmt: skip
    whole = tok.encode(text, add_special_tokens=False).ids
    pieces = list(text_pieces(text, size=997))
    assert len(pieces) > 50 and "".join(pieces) == text
    assert [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids] == whole
    assert list(text_pieces("x" * 2500, size=1000)) == ["x" * 1000, "x" * 1000, "x" * 500]


def test_files_are_read_in_blocks_cut_before_a_word(tmp_path: Path) -> None:
    """prepare reads a file in blocks (bounded memory for a corpus of any size): the blocks
    are the file, each cut before a word or, with none near, at a UTF-8 boundary; the
    byte tokenizer's ids and a dataset prepared from them are those of the whole file."""
    from atom.data.tokens import file_blocks

    rng = np.random.default_rng(1)
    words = ["über", "naïve", "fox", "—", "dog", "42"]
    text = "".join(rng.choice(words) + rng.choice([" ", "\n", "  "]) for _ in range(3000))
    src = tmp_path / "words.txt"
    src.write_text(text)
    blocks = list(file_blocks(src, size=1000))
    assert b"".join(blocks) == src.read_bytes() and len(blocks) > 10
    assert all(len(b) <= 1000 for b in blocks)
    assert all(b[:1] in (b" ", b"\n") for b in blocks[1:])  # each starts its word
    dense = tmp_path / "dense.txt"
    dense.write_text("é" * 3000)  # no whitespace at all: cut between characters
    parts = list(file_blocks(dense, size=1001))
    assert b"".join(parts) == dense.read_bytes()
    assert all(p.decode("utf-8") for p in parts)  # every block decodes on its own
    import atom.text.tokenize as tokenize

    small = tokenize.BLOCK_BYTES
    try:
        tokenize.BLOCK_BYTES = 1000
        prepare([src], tmp_path / "ds", progress=False)
    finally:
        tokenize.BLOCK_BYTES = small
    ids = np.concatenate(
        [read_split(tmp_path / "ds", n, "uint8") for n in ("train.bin", "val.bin")]
    )
    assert ids.tobytes() == src.read_bytes()


def test_a_split_too_small_for_one_window_names_the_fix(tmp_path: Path, caplog) -> None:
    src = tmp_path / "t.txt"
    src.write_bytes(b"abcdefghij" * 3)
    out = tmp_path / "d"
    prepare([src], out, val_fraction=0.03, progress=False)  # 1 val token
    with pytest.raises(DataError, match=r"val split .* has 1 token.*larger --val-fraction"):
        TokenData(out, seq_len=8, seed=0)
    with caplog.at_level(logging.WARNING, logger="atom.data.tokens"):
        prepare([src], out, val_fraction=0.5, progress=False)
        data = TokenData(out, seq_len=64, seed=0)
    assert "the train split" in caplog.text and "windows are 14 tokens long" in caplog.text
    x, y, *_ = data.train_batch(3, 0, 4)
    assert x.shape == (4, 14) and (y[:, :-1] == x[:, 1:]).all()
