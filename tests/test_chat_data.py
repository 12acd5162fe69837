"""Chat, instruction and prompt/completion records: only the answers are learned, and
packed windows keep the documents apart.

    pytest tests/test_chat_data.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from atom.cli import main
from atom.data.tokens import LEARN, START, DataError, TokenData, prepare
from atom.model.documents import IGNORE
from tests.bpe_util import byte_level_bpe, save_tokenizer

CHAT = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Red."},
    ]
}
RECORDS = [
    CHAT,
    {"instruction": "Add one to two.", "output": "Three."},
    {"instruction": "Sort", "input": "b a", "output": "a b"},
    {"prompt": "The capital of France is", "completion": " Paris."},
    {"text": "Plain text is learned whole."},
]


def _write(path: Path, records, times: int = 1) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records * times))
    return path


def _all(d: Path) -> tuple[bytes, np.ndarray]:
    ids = b"".join((d / n).read_bytes() for n in ("train.bin", "val.bin"))
    flags = np.concatenate(
        [np.fromfile(d / n, dtype=np.uint8) for n in ("train.flags", "val.flags")]
    )
    return ids, flags


def _learned(ids: bytes, flags: np.ndarray) -> list[bytes]:
    """The learned runs of bytes, in order."""
    out, run = [], b""
    for b, f in zip(ids, flags, strict=True):
        if f & LEARN:
            run += bytes([b])
        elif run:
            out.append(run)
            run = b""
    return out + ([run] if run else [])


def test_only_answers_are_learned_byte_tokenizer(tmp_path):
    meta = prepare([_write(tmp_path / "r.jsonl", RECORDS)], tmp_path / "d", progress=False)
    assert meta.documents
    ids, flags = _all(tmp_path / "d")
    assert len(flags) == len(ids)
    # ChatML without a template: each assistant turn's content and end marker; the blank
    # line that ends a record stands for the end-of-text token and is learned too
    assert _learned(ids, flags) == [
        b"Blue.<|im_end|>\n",
        b"Red.<|im_end|>\n\n\n",
        b"Three.\n\n",
        b"a b\n\n",
        b" Paris.\n\nPlain text is learned whole.\n\n",  # (a text record: all of it)
    ]
    starts = np.flatnonzero(flags & START)
    assert len(starts) == len(RECORDS) and starts[0] == 0
    assert ids[starts[1] :].startswith(b"### Instruction:\nAdd one to two.")


def test_learn_prompts_learns_everything(tmp_path):
    src = _write(tmp_path / "r.jsonl", RECORDS)
    assert main(["prepare", str(src), "--out", str(tmp_path / "d"), "--learn-prompts"]) == 0
    ids, flags = _all(tmp_path / "d")
    assert (flags & LEARN).all() and np.count_nonzero(flags & START) == len(RECORDS)


def test_chat_template_of_the_checkpoint_marks_assistant_turns(tmp_path):
    pytest.importorskip("jinja2")
    tok = byte_level_bpe([json.dumps(r) for r in RECORDS] * 20, ["<|eot|>", "<|start|>", "<|end|>"],
                         vocab_size=400)  # fmt: skip
    template = (
        "{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
    )
    tok_dir = save_tokenizer(
        tok, tmp_path / "tok", {"eos_token": "<|eot|>", "chat_template": template}
    )
    meta = prepare([_write(tmp_path / "c.jsonl", [CHAT])], tmp_path / "d", str(tok_dir),
                   val_fraction=0.01, progress=False)  # fmt: skip
    ids = np.concatenate([np.fromfile(tmp_path / "d" / n, dtype=meta.dtype) for n in
                          ("train.bin", "val.bin")])  # fmt: skip
    _, flags = _all(tmp_path / "d")
    learned = [i for i, f in zip(ids.tolist(), flags, strict=True) if f & LEARN]
    text = tok.decode(learned, skip_special_tokens=False)
    assert text == "Blue.<|end|>Red.<|end|><|eot|>"
    read = tok.decode([i for i, f in zip(ids.tolist(), flags, strict=True) if not f & LEARN],
                      skip_special_tokens=False)  # fmt: skip
    assert "Name a colour." in read and "<|start|>assistant\n" in read and "Blue" not in read


def test_an_answer_token_that_takes_the_prompts_space_is_learned(tmp_path):
    """Byte-level BPE folds the space ending a prompt into the answer's first token
    ("Ġ" + "Paris"): that token is the answer's and is learned."""
    tok = byte_level_bpe(["The capital of France is Paris. "] * 50, ["<|endoftext|>"])
    save_tokenizer(tok, tmp_path / "tok", {"eos_token": "<|endoftext|>"})
    record = {"prompt": "The capital of France is ", "completion": "Paris."}
    meta = prepare([_write(tmp_path / "r.jsonl", [record] * 4)], tmp_path / "d",
                   str(tmp_path / "tok"), val_fraction=0.25, progress=False)  # fmt: skip
    ids = np.concatenate([np.fromfile(tmp_path / "d" / n, dtype=meta.dtype)
                          for n in ("train.bin", "val.bin")])  # fmt: skip
    _, flags = _all(tmp_path / "d")
    first = ids[: len(ids) // 4]  # one record
    learned = [int(i) for i, f in zip(first, flags[: len(first)], strict=True) if f & LEARN]
    assert tok.decode(learned, skip_special_tokens=False) == " Paris.<|endoftext|>"


def test_windows_keep_documents_apart_and_ignore_prompts(tmp_path):
    prepare([_write(tmp_path / "r.jsonl", RECORDS, times=30)], tmp_path / "d", progress=False)
    T = 256  # longer than every record (the chat is ~200 bytes)
    data = TokenData(tmp_path / "d", seq_len=T, seed=1)
    ids, flags = _all(tmp_path / "d")
    tokens = np.frombuffer(ids, dtype=np.uint8)
    doc_starts = set(np.flatnonzero(flags & START).tolist())
    n_learned = 0
    for step in range(20):
        x, y, pos = data.train_batch(step, 0, 4)
        assert x.shape == y.shape == pos.shape == (4, T)
        for row in range(4):
            # the row's first token starts a document (every record is shorter than T)
            at = _find(tokens, x[row])
            assert at in doc_starts
            # positions restart exactly where documents start
            for t in range(T):
                expect = 0 if t == 0 or at + t in doc_starts else int(pos[row, t - 1]) + 1
                assert int(pos[row, t]) == expect
                learn = flags[at + t + 1] & LEARN and (at + t + 1) not in doc_starts
                assert (int(y[row, t]) == IGNORE) == (not learn)
                if learn:
                    assert int(y[row, t]) == tokens[at + t + 1]
                    n_learned += 1
    assert n_learned > 0
    val = data.val_batches(2, 4)
    assert all(len(b) == 3 for b in val)


def _find(tokens: np.ndarray, row: torch.Tensor) -> int:
    want = row.numpy().astype(np.uint8).tobytes()
    at = tokens.tobytes().find(want)
    assert at >= 0
    return at


def test_a_document_longer_than_the_window_is_read_from_anywhere(tmp_path):
    long_text = {"text": "".join(chr(97 + i % 26) for i in range(3000))}
    prepare([_write(tmp_path / "r.jsonl", [long_text, *RECORDS], times=2)], tmp_path / "d",
            progress=False)  # fmt: skip
    data = TokenData(tmp_path / "d", seq_len=32, seed=0)
    firsts = set()
    for step in range(40):
        x, _, pos = data.train_batch(step, 0, 8)
        firsts |= {bytes(r[:1].numpy().astype(np.uint8)) for r in x}
        assert (pos[:, 0] == 0).all()
    assert len(firsts) > 5  # many starting letters: windows inside the long document


def test_val_split_begins_at_a_document(tmp_path):
    meta = prepare([_write(tmp_path / "r.jsonl", RECORDS, times=20)], tmp_path / "d",
                   val_fraction=0.13, progress=False)  # fmt: skip
    val_flags = np.fromfile(tmp_path / "d" / "val.flags", dtype=np.uint8)
    assert val_flags[0] & START and len(val_flags) == meta.val_tokens


def test_records_with_nothing_to_learn_are_refused_at_load(tmp_path):
    """Prompts with no answers (and chats with no assistant turn): not even the end of
    the text is learned (it would teach stopping after a prompt), so the split has
    nothing to learn, said in one line at load."""
    records = [{"prompt": "p" * 40, "completion": ""},
               {"messages": [{"role": "user", "content": "hello?"}]}] * 20  # fmt: skip
    prepare([_write(tmp_path / "r.jsonl", records)], tmp_path / "d", progress=False)
    _, flags = _all(tmp_path / "d")
    assert not (flags & LEARN).any()
    with pytest.raises(DataError, match="no token of the train split is to be learned"):
        TokenData(tmp_path / "d", seq_len=16, seed=0)


def test_one_long_conversation_still_gives_windows(tmp_path):
    """A val split inside one document (no document starts in it) reads plain windows."""
    long_chat = {"messages": [{"role": "user", "content": "q " * 50},
                              {"role": "assistant", "content": "a " * 2000}]}  # fmt: skip
    prepare([_write(tmp_path / "r.jsonl", [long_chat])], tmp_path / "d", progress=False)
    assert not (np.fromfile(tmp_path / "d" / "val.flags", dtype=np.uint8) & START).any()
    data = TokenData(tmp_path / "d", seq_len=32, seed=0)
    x, y, pos = data.val_batches(1, 4)[0]
    assert x.shape == (4, 32) and (pos[:, 0] == 0).all() and (y != IGNORE).any()


def test_val_split_begins_at_the_document_start_nearest_the_cut(tmp_path):
    """Records of 98, 2002 and 4 bytes (each with its blank line): the document starts are
    0, 98 and 2100. A planned cut at 200 goes back to 98, not on to 2100 (which would
    leave a 4-token val split)."""
    records = [{"text": "a" * 96}, {"text": "x" * 2000}, {"text": "ab"}]
    meta = prepare([_write(tmp_path / "r.jsonl", records)], tmp_path / "d",
                   val_fraction=1904 / 2104, progress=False)  # fmt: skip
    assert meta.train_tokens == 98 and meta.val_tokens == 2006


def test_missing_or_truncated_flags_are_one_line(tmp_path):
    prepare([_write(tmp_path / "r.jsonl", RECORDS, times=20)], tmp_path / "d", progress=False)
    flags = tmp_path / "d" / "train.flags"
    flags.write_bytes(flags.read_bytes()[:-3])
    with pytest.raises(DataError, match=r"train.flags has .* bytes .* re-run atom prepare"):
        TokenData(tmp_path / "d", seq_len=16, seed=0)
    flags.unlink()
    with pytest.raises(DataError, match=r"train.flags is missing"):
        TokenData(tmp_path / "d", seq_len=16, seed=0)


def test_plain_text_over_records_drops_the_old_flags(tmp_path):
    prepare([_write(tmp_path / "r.jsonl", RECORDS, times=20)], tmp_path / "d", progress=False)
    (tmp_path / "t.txt").write_text("plain text " * 200)
    meta = prepare([tmp_path / "t.txt"], tmp_path / "d", progress=False)
    assert not meta.documents and not (tmp_path / "d" / "train.flags").exists()
    assert len(TokenData(tmp_path / "d", seq_len=16, seed=0).train_batch(0, 0, 2)) == 2


def _train_on_records(tmp_path, *sets: str) -> Path:
    """`atom train` (swapped, CPU) on RECORDS x 40; the run directory."""
    prepare([_write(tmp_path / "r.jsonl", RECORDS, times=40)], tmp_path / "d", progress=False)
    out = tmp_path / "run"
    sets = (f"train.data={tmp_path / 'd'}", "train.device=cpu", "train.dtype=fp32", *sets)
    args = ["train", "--out", str(out), "--no-progress", *(a for s in sets for a in ("--set", s))]
    assert main(args) == 0
    return out


def test_training_on_chat_records_runs_swapped(tmp_path, capsys):
    out = _train_on_records(tmp_path, "model.seq_len=64", "train.max_steps=4",
                            "train.eval_interval=2")  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert any("val_loss" in r and np.isfinite(r["val_loss"]) for r in rows)
    # and the run answers in the layout it was trained on
    chat = ["generate", str(out), "--chat", "--prompt", "Name a colour.", "--tokens", "8"]
    assert main(chat) == 0


def test_the_readme_example_file_prepares(tmp_path):
    example = Path(__file__).parents[1] / "docs" / "examples" / "chat.jsonl"
    meta = prepare([example], tmp_path / "d", progress=False)
    ids, flags = _all(tmp_path / "d")
    learned = b"".join(_learned(ids, flags))
    assert meta.documents and np.count_nonzero(flags & START) == 5
    assert b"Only the units it is computing" in learned and b"What does atom" not in learned


def test_eval_of_records_scores_only_the_answers_as_plain_pytorch_does(tmp_path):
    """`atom eval RUN --data FILE.jsonl`: windows of the records' tokens, only learned
    targets scored and each document read alone; the token-weighted mean equals the
    model's loss over the same windows in one plain-PyTorch call."""
    import math

    from atom.commands.evaluate import evaluate_run
    from atom.config import Config
    from atom.model import build_model, materialize
    from atom.model.documents import Documents
    from atom.store.checkpoint import load_checkpoint

    out = _train_on_records(tmp_path, "model.seq_len=32", "train.max_steps=2",
                            "train.eval_interval=0")  # fmt: skip
    held = _write(tmp_path / "held.jsonl", RECORDS, times=3)
    r = evaluate_run(out, held, batch=3)

    prepare([held], tmp_path / "h", val_fraction=0.5, progress=False)
    ids, flags = _all(tmp_path / "h")
    ckpt = load_checkpoint(out)
    cfg = Config.from_dict(ckpt.meta["config"])
    model = materialize(build_model(cfg.model), seed=0)
    T, n = 32, (len(ids) - 1) // 32
    tokens = torch.tensor(list(ids[: n * T + 1]))
    pos = torch.zeros(n, T, dtype=torch.long)
    y = tokens[1:].view(n, T).clone()
    for w in range(n):
        for t in range(T):
            i = w * T + t
            pos[w, t] = 0 if t == 0 or flags[i] & START else pos[w, t - 1] + 1
            if not flags[i + 1] & LEARN or flags[i + 1] & START:
                y[w, t] = IGNORE
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ckpt.get(name))
        _, want = model(tokens[:-1].view(n, T), y, docs=Documents(pos))
    assert r.tokens == int((y != IGNORE).sum()) < n * T
    assert math.isclose(r.loss, float(want), rel_tol=1e-5)
