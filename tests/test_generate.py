"""`atom generate` with and without the KV cache: the same text, every architecture.

pytest tests/test_generate.py
"""

from __future__ import annotations

import pytest
import torch

from atom.commands.generate import generate
from atom.model import build_model, materialize
from atom.model.kv_cache import KVCache
from atom.store.checkpoint import save_checkpoint
from tests.bpe_util import byte_level_bpe, save_tokenizer, script_generation
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "model",
    [{}, {"arch": "llama"}, {"arch": "llama", "sliding_window": 8},
     {"arch": "llama", "rope_type": "llama3", "rope_factor": 4.0,
      "rope_original_max_position": 8},
     {"arch": "llama", "rope_type": "yarn", "rope_factor": 4.0,
      "rope_original_max_position": 8}],
    ids=["gpt", "llama", "llama-window", "llama3-rope", "yarn-rope"],
)  # fmt: skip
def test_cached_logits_equal_a_full_forward(model):
    """Prompt then one token at a time through the cache: each step's logits are those of
    running the whole sequence so far."""
    cfg = tiny_config(model={**model, "seq_len": 32})
    net = materialize(build_model(cfg.model), seed=3).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg.model.n_layer)
    with torch.no_grad():
        got = [net(ids[:, :10], cache=cache)[0]]
        for t in range(10, 24):
            got.append(net(ids[:, t : t + 1], cache=cache)[0])
        want = net(ids)[0]
    assert cache.pos == 24
    assert torch.allclose(torch.cat(got, dim=1), want, atol=1e-5)


def _run_dir(tmp_path, model) -> str:
    cfg = tiny_config(model={**model, "seq_len": 16})
    net = materialize(build_model(cfg.model), seed=1)
    meta = {"config": cfg.to_dict(), "data": {"tokenizer": "byte"}}
    save_checkpoint(tmp_path, 1, [("unit_000", dict(net.named_parameters()))], meta)
    return tmp_path


@pytest.mark.parametrize(
    "model", [{}, {"arch": "llama", "sliding_window": 6}], ids=["gpt", "llama"]
)
def test_generate_with_and_without_the_cache_is_the_same_text(tmp_path, model):
    """40 tokens from a 16-token model: within the context and past it (where both see the
    last 16 tokens), sampled with the same seed."""
    run = _run_dir(tmp_path, model)
    on = generate(run, "the ", 40, temperature=0.8, top_k=20, seed=5, use_cache=True)
    off = generate(run, "the ", 40, temperature=0.8, top_k=20, seed=5, use_cache=False)
    assert on.text == off.text and on.tokens == off.tokens == 40


def test_generation_stops_at_the_end_of_text_token(tmp_path, monkeypatch):
    import atom.commands.generate as gen

    run = _run_dir(tmp_path, {})
    first = gen.generate(run, "a", 1, temperature=0.0, top_k=1).text[-1:]  # greedy's pick
    real = gen._codec

    def with_eos(spec, chat=False):
        encode, decode, _ = real(spec, chat)
        return encode, decode, ord(first)

    monkeypatch.setattr(gen, "_codec", with_eos)
    out = gen.generate(run, "a", 30, temperature=0.0, top_k=1)
    assert out.stopped_at_eos and out.tokens == 0 and out.text == "a"


def test_generating_does_not_grow_the_rope_table_cache(tmp_path):
    from atom.model import llama

    run = _run_dir(tmp_path, {"arch": "llama"})
    generate(run, "the ", 5, seed=0)
    before = len(llama._ROPE_CACHE)
    generate(run, "the ", 60, seed=1)  # within and past the 16-token context
    assert len(llama._ROPE_CACHE) <= before + 1


def test_end_of_turn_markers():
    from atom.commands.generate import end_of_turn
    from atom.text.records import chatml

    assert end_of_turn(chatml) == "<|im_end|>"

    def llama3(messages, add_generation_prompt=False):
        body = "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
            for m in messages
        )
        return "<|begin_of_text|>" + body

    assert end_of_turn(llama3) == "<|eot_id|>"


def test_chat_lays_out_the_prompt_and_stops_at_the_end_of_the_turn(tmp_path, monkeypatch):
    """A scripted model writes "Blue.<|im_end|>\\nmore": the reply is "Blue.", generation
    stops at the marker, and the model read the ChatML prompt with the system message."""
    import atom.commands.generate as gen

    run = _run_dir(tmp_path, {})
    seen = script_generation(monkeypatch, list(b"Blue.<|im_end|>\nmore"), 256)
    out = gen.generate(run, "Name a colour.", 50, chat=True, system="Be terse.")
    prompt = (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert bytes(seen[0]).decode() == prompt
    assert out.reply == "Blue." and out.stopped_at_eos
    assert out.tokens == len("Blue.<|im_end|>")
    assert out.text == prompt + "Blue.<|im_end|>"


def test_system_without_chat_is_one_line(tmp_path, capsys):
    from atom.cli import main

    run = _run_dir(tmp_path, {})
    assert main(["generate", str(run), "--system", "x"]) == 2
    assert "add --chat" in capsys.readouterr().err


def test_chat_with_a_bpe_tokenizer_stops_at_a_special_end_of_turn(tmp_path, monkeypatch):
    """The end-of-turn marker is a special token of the tokenizer: it is seen (decoded as
    text) and stops the reply; the template's BOS is the only one (no second from the
    tokenizer)."""
    pytest.importorskip("jinja2")
    pytest.importorskip("tokenizers")
    from tokenizers import processors

    import atom.commands.generate as gen

    tok = byte_level_bpe(["Name a colour. Blue. more"] * 20, ["<s>", "<|im_start|>", "<|im_end|>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok_dir = save_tokenizer(tok, tmp_path / "tok", {"bos_token": "<s>", "eos_token": "<s>",
                                                     "chat_template": template})  # fmt: skip
    cfg = tiny_config(model={"seq_len": 64, "vocab_size": 300})
    net = materialize(build_model(cfg.model), seed=1)
    meta = {
        "config": cfg.to_dict(),
        "data": {"tokenizer": f"tokenizers:{tok_dir / 'tokenizer.json'}"},
    }
    run = tmp_path / "run"
    save_checkpoint(run, 1, [("unit_000", dict(net.named_parameters()))], meta)
    script = tok.encode("Blue.", add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]
    script += tok.encode(" more", add_special_tokens=False).ids
    seen = script_generation(monkeypatch, script, 300)
    out = gen.generate(run, "Name a colour.", 20, chat=True)
    assert seen[0].count(bos) == 1 and seen[0][0] == bos
    assert out.reply == "Blue." and out.stopped_at_eos
    assert out.tokens == len(script) - len(tok.encode(" more", add_special_tokens=False).ids)


def test_a_small_model_decodes_on_one_thread_and_leaves_the_count_alone(tmp_path, monkeypatch):
    """A 0.8M-parameter model decoded 11-37 tokens/s on every core of a loaded box and
    478-501 on one: token-by-token decoding of a small model runs on one thread."""
    import atom.commands.generate as gen_mod
    from atom.ground.threads import decode_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with decode_threads(64) as n:
            assert n == 1 == torch.get_num_threads()
        assert torch.get_num_threads() == 2
        with decode_threads(2048) as n:  # a wide model: matrix-vector products worth a team
            assert n == 2 == torch.get_num_threads()
        seen, real = [], gen_mod._next_logits

        def counting(*args):
            seen.append(torch.get_num_threads())
            return real(*args)

        monkeypatch.setattr(gen_mod, "_next_logits", counting)
        out = generate(_run_dir(tmp_path, {}), "the ", 5, seed=1)
        assert out.threads == 1 and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
