"""Hugging Face checkpoints in and out: LLaMA, Mistral, Qwen2 and GPT-2 (atom/hf/).

    .venv/bin/pytest -q tests/test_hf.py

Tiny random models are built locally with transformers' config classes and saved with
save_pretrained (several safetensors shards), never downloaded. For each family: atom's
logits equal transformers' (fp32, 1e-4); three swapped training steps through Trainer on
data prepared with the checkpoint's tokenizer; `atom export`; transformers loads the export
and reproduces atom's logits on the trained weights. Also: peak host RAM while loading is
about one copy of the model, unsupported variants are refused with one line, JSONL records.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from atom.model.documents import Documents, positions_in_documents

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from atom.cli import main  # noqa: E402
from atom.config import replace  # noqa: E402
from atom.data.tokens import TokenData, prepare  # noqa: E402
from atom.hf import HFSource, model_bytes  # noqa: E402
from atom.model import build_model, materialize  # noqa: E402
from atom.run.run_config import load_run_config  # noqa: E402
from atom.run.train import Trainer  # noqa: E402
from atom.store.checkpoint import load_checkpoint  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 300
WORDS = (
    "a checkpoint from the hub is fine tuned on one card while the units stream through "
    "the device and the host keeps the master weights of every layer"
).split()
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"


def tiny_hf_config(family: str, **extra):
    common = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **common)
    llama_like = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        **common,
    }
    if family == "llama":
        return transformers.LlamaConfig(rope_theta=5000.0, **llama_like, **extra)
    if family == "mistral":
        return transformers.MistralConfig(**{"sliding_window": 64, **llama_like, **extra})
    if family == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True, **llama_like, **extra)
    raise ValueError(family)


CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def save_hf(family: str, out: Path, tok_dir: Path, dtype=torch.float32, shard="40KB", **extra):
    """A random tiny model of `family` in `out`, perturbed so that norms and biases are not
    their trivial init (a mapping mistake then shows in the logits)."""
    torch.manual_seed(hash(family) % 1000)
    model = getattr(transformers, CLASSES[family])(tiny_hf_config(family, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.to(dtype).save_pretrained(out, safe_serialization=True, max_shard_size=shard)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out / name)
    return out


def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def atom_model(cfg, get):
    model = materialize(build_model(cfg.model), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(get(name))
    return model.eval()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (vocab 300) trained here, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return root


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory, tok_dir) -> Path:
    """Text and JSONL records prepared with the checkpoint directory's tokenizer."""
    root = tmp_path_factory.mktemp("hfdata")
    rng = random.Random(1)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300))
    (root / "notes.txt").write_text(text)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(100):
            a, b = (" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(2))
            f.write(json.dumps({"text": a}) + "\n")
            f.write(json.dumps({"instruction": a, "output": b}) + "\n")
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": a},
                            {"role": "assistant", "content": b},
                        ]
                    }
                )
                + "\n"
            )
    out = root / "data"
    assert main(["prepare", str(root), "--out", str(out), "--tokenizer", str(tok_dir)]) == 0
    return out


TRAIN = [
    "train.device=cpu",
    "train.dtype=fp32",
    "train.micro_batch=2",
    "train.max_steps=3",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    "train.eval_batches=1",
    "train.ckpt_interval=0",
    "model.seq_len=32",
    "swap.layers_per_unit=1",
    "swap.prefetch=1",
]


def each_document(model, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A packed row's logits, each document run through `model` alone."""
    cuts = [*(positions == 0).nonzero().flatten().tolist(), len(x)]
    return torch.cat([model(x[None, a:b]).logits[0] for a, b in itertools.pairwise(cuts)])


@pytest.mark.parametrize(
    "family,dtype",
    [
        ("llama", torch.bfloat16),  # bf16 weights: cast to the fp32 master on load
        ("mistral", torch.float32),
        ("qwen2", torch.float32),  # q/k/v biases, tied embeddings
        ("gpt2", torch.float32),  # Conv1D transposes, biases, learned positions sliced to 32
    ],
)
def test_load_train_export_roundtrip(tmp_path, tok_dir, hf_data, family, dtype, capsys):
    src = save_hf(family, tmp_path / "src", tok_dir, dtype=dtype)
    assert len(list(src.glob("model-*.safetensors"))) >= 2  # sharded, with an index
    cfg = load_run_config(None, [*TRAIN, f"train.data={hf_data}"], model=str(src))
    assert cfg.model.init_from == str(src.resolve())

    # 1. loaded weights give transformers' logits
    reference = hf_model(src)
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = atom_model(cfg, HFSource(src).getter(cfg.model))(x)[0]
        theirs = reference(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    # and three documents packed in a row read as each alone
    starts = torch.zeros(1, 32, dtype=torch.bool)
    starts[0, [0, 9, 20]] = True
    pos = positions_in_documents(starts)
    with torch.no_grad():
        ours = atom_model(cfg, HFSource(src).getter(cfg.model))(x[:1], docs=Documents(pos))[0]
        theirs = each_document(reference, x[0], pos[0])[None]
    assert (ours - theirs).abs().max().item() <= 1e-4

    # 2. three swapped steps; the first loss is transformers' loss on the same batch
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    assert type(trainer.engine).__name__ == "SwapEngine"
    # (the records make a dataset of documents: transformers reads each one on its own, and
    # the targets not to learn are -100, cross_entropy's ignore_index)
    bx, by, pos = TokenData(hf_data, 32, cfg.train.seed).train_batch(0, 0, cfg.train.micro_batch)
    assert (by == -100).any()  # the prompts are not learned
    with torch.no_grad():
        logits = torch.stack([each_document(reference, x, p) for x, p in zip(bx, pos, strict=True)])
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), by.reshape(-1))
    summary = trainer.run()
    assert summary.steps == 3
    assert abs(summary.history[0]["loss"] - want.item()) <= 1e-4
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in summary.history)

    # 3. export; transformers loads it and reproduces atom's logits on the trained weights
    out = tmp_path / "export"
    assert (
        main(["export", str(tmp_path / "run"), "--hf", str(out), "--max-shard-size", "30KB"]) == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file()
    written = json.loads((out / "config.json").read_text())
    exported_dtype = written.get("dtype") or written.get("torch_dtype")
    assert exported_dtype == str(dtype).removeprefix("torch.")
    if dtype != torch.float32:  # compare at full precision
        out = tmp_path / "export32"
        assert main(["export", str(tmp_path / "run"), "--hf", str(out), "--dtype", "fp32"]) == 0
        assert (out / "model.safetensors").is_file()  # fits one shard: no index
    ckpt = load_checkpoint(tmp_path / "run")
    trained = atom_model(cfg, ckpt.get)
    exported = hf_model(out)
    with torch.no_grad():
        ours, theirs = trained(x)[0], exported(x).logits
        before = atom_model(cfg, HFSource(src).getter(cfg.model))(x)[0]
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours - before).abs().max().item() > 1e-3  # training changed the model
    if family == "gpt2":  # positions past the trained 32 keep the source's rows
        wpe_out = exported.transformer.wpe.weight
        assert torch.equal(wpe_out[32:], reference.transformer.wpe.weight[32:])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("the device").input_ids) == "the device"


PEAK_RAM_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, threading, time
    import psutil, torch
    from atom.run.run_config import load_run_config
    from atom.hf import load_weights, model_bytes
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine

    cfg = load_run_config(None, ["train.device=cpu", "train.dtype=fp32"], model=sys.argv[1])
    engine = SwapEngine(cfg, CpuBackend(), torch.float32, init=False)  # buffers not yet touched
    proc = psutil.Process()
    base = proc.memory_info().rss
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    load_weights(engine, cfg)
    done.set()
    sampler.join()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    top = max(peak[0], proc.memory_info().rss, maxrss if maxrss > maxrss_before else 0)
    largest = max(4 * t.numel() for t in engine.named_parameters().values())
    print(json.dumps({"growth": top - base, "model": model_bytes(cfg.model), "largest": largest}))
    """
)


def test_peak_host_ram_while_loading_is_one_copy(tmp_path, tok_dir):
    """A 50 MB (fp32) model in two shards: loading raises the process's RSS by the model's
    own fp32 bytes (the engine's master buffers) plus the one tensor in flight (here the
    12 MB embedding; about 1% of a 7B model), not by a second copy of the model."""
    cfg = transformers.LlamaConfig(
        vocab_size=8000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    tensors = {n: torch.randn(p.shape) * 0.02 for n, p in meta.state_dict().items()}
    del meta
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    cfg.save_pretrained(src)
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file(
            {n: tensors[n] for n in part}, str(src / f"model-{i}.safetensors"), {"format": "pt"}
        )
    del tensors
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RAM_SCRIPT, str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ratio = result["growth"] / result["model"]
    print(f"model {result['model'] / 2**20:.1f} MiB, RSS growth while loading {ratio:.2f}x")
    assert 0.8 < ratio < 1.5
    assert result["growth"] < result["model"] + result["largest"] + 4 * 2**20
    assert result["model"] == model_bytes(load_run_config(None, [], model=str(src)).model)


def edit_config(path: Path, **changes) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "family,changes,argv,needle",
    [
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, [], "rope_scaling"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}},
            [],
            "'longrope' is not supported",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
            [],
            "lacks 'low_freq_factor'",
        ),
        ("llama", {"attention_bias": True}, [], "attention_bias"),
        (  # a window only one of its two layers uses: atom's layers share one attention
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 16,
                "max_window_layers": 1,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            ["--set", "model.seq_len=32"],
            "sliding_window=16, which only some of its layers use",
        ),
        ("gpt2", {}, ["--set", "model.seq_len=128"], "n_positions=64"),
        ("qwen2", {}, ["--set", "model.n_layer=1"], "model.n_layer=1 does not match"),
        ("llama", {"model_type": "falcon"}, [], "model_type 'falcon' is not supported"),
    ],
)
def test_unsupported_is_refused_in_one_line(
    tmp_path, tok_dir, capsys, family, changes, argv, needle
):
    src = edit_config(save_hf(family, tmp_path / "src", tok_dir), **changes)
    code = main(["train", "--model", str(src), *argv, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err
    assert err.count("\n") == 1 and err.startswith("atom: error: ")


def test_a_fine_tune_says_what_the_checkpoint_is(tmp_path, tok_dir, hf_data, capsys):
    """issue 42: fine-tuning a Qwen2 checkpoint announced "training llama" (atom's block
    family); the first line names the checkpoint's architecture and model_type."""
    src = save_hf("qwen2", tmp_path / "src", tok_dir)
    sets = [x for item in [*TRAIN, f"train.data={hf_data}"] for x in ("--set", item)]
    argv = ["train", "--model", str(src), *sets, "--max-steps", "1", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"atom: training Qwen2ForCausalLM (qwen2) from {src.resolve()} (" in out, out
    assert "training llama" not in out


def test_missing_checkpoint_directory_is_refused(tmp_path, capsys):
    code = main(["train", "--model", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2 and "is not a directory" in err and err.count("\n") == 1


def test_config_file_with_hf_model_and_override(tmp_path, tok_dir, hf_data):
    """`model: hf:PATH` in YAML and a mapping with init_from plus overrides both work."""
    src = save_hf("qwen2", tmp_path / "src", tok_dir)
    (tmp_path / "a.yaml").write_text(f"model: hf:{src}\n")
    (tmp_path / "b.yaml").write_text(f"model:\n  init_from: {src}\n  seq_len: 16\n")
    a = load_run_config(tmp_path / "a.yaml")
    b = load_run_config(tmp_path / "b.yaml")
    assert a.model.seq_len == 64 and a.model.qkv_bias and a.model.tied
    assert b.model.seq_len == 16 and b.model.init_from == a.model.init_from
    # the run's saved config (a JSON mapping with init_from) loads back the same
    (tmp_path / "c.json").write_text(json.dumps(b.to_dict()))
    assert load_run_config(tmp_path / "c.json") == b


def test_jsonl_records_and_chat_template(tmp_path, tok_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    src = tmp_path / "r.jsonl"
    records = [
        {"text": "the device"},
        {"prompt": "the host ", "completion": "keeps"},
        {"messages": [{"role": "user", "content": "a card"}]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    meta = prepare([src], tmp_path / "d", tokenizer=str(tok_dir), val_fraction=0.1, progress=False)
    assert meta.tokenizer == f"tokenizers:{(tok_dir / 'tokenizer.json').resolve()}"
    import numpy as np

    ids = np.concatenate(
        [
            np.fromfile(tmp_path / "d" / "train.bin", dtype=meta.dtype),
            np.fromfile(tmp_path / "d" / "val.bin", dtype=meta.dtype),
        ]
    ).tolist()
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.count("<|endoftext|>") == 3 and ids[-1] == eos
    assert "the host keeps" in text and "<|user|>a card" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    from atom.data.tokens import DataError

    with pytest.raises(DataError, match=r"bad.jsonl:2 has no \"text\""):
        prepare([bad], tmp_path / "e", tokenizer=str(tok_dir), progress=False)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_export_model_trained_from_scratch(tmp_path, text_dataset, arch):
    """A model atom trained from scratch exports too (GPT-2 layout gets zero biases)."""
    overrides = [
        f"model.arch={arch}",
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=4",
        "model.seq_len=32",
        "train.max_steps=1",
        "train.micro_batch=2",
        "train.eval_interval=0",
        "train.eval_batches=1",
        "train.device=cpu",
        "train.dtype=fp32",
        f"train.data={text_dataset}",
    ]
    cfg = load_run_config(None, overrides)
    Trainer(cfg, tmp_path / "run", progress=False).run()
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--hf", str(out)]) == 0
    ckpt = load_checkpoint(tmp_path / "run")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = atom_model(cfg, ckpt.get)(x)[0]
        theirs = hf_model(out)(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_export_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_fine_tuning_on_another_tokenizers_data_is_refused(tmp_path):
    """Byte ids (or another tokenizer's ids) fed to a checkpoint train its embeddings on
    the wrong text: refused, with the prepare command that fixes it (they were warnings)."""
    from types import SimpleNamespace

    from atom.ground.errors import DataError
    from atom.hf.source import _check_tokenizer

    with pytest.raises(DataError, match=f"--tokenizer {tmp_path}"):
        _check_tokenizer(SimpleNamespace(path=tmp_path), "byte")
    (tmp_path / "tokenizer.json").write_text('{"model": "theirs"}')
    other = tmp_path / "other.json"
    other.write_text('{"model": "mine"}')
    with pytest.raises(DataError, match="differs from .*--tokenizer"):
        _check_tokenizer(SimpleNamespace(path=tmp_path), f"tokenizers:{other}")
    _check_tokenizer(SimpleNamespace(path=tmp_path), f"tokenizers:{tmp_path / 'tokenizer.json'}")


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        # Llama 3.1's, with a short original context so that all three frequency bands
        # (kept, ramped, divided) occur in a 64-dim head
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        # Qwen2.5's long-context YaRN, its ramp inside a 16-dim head; and with DeepSeek's
        # mscale pair and untruncated ramp ends
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.5,
         "truncate": False},
    ],
    ids=["linear", "llama3", "yarn", "yarn-mscale"],
)  # fmt: skip
def test_scaled_rope_checkpoints_give_transformers_logits(tmp_path, tok_dir, hf_data, scaling):
    """Llama 3.x (rope type llama3) and linearly scaled RoPE load, and give transformers'
    logits to fp32 precision on a sequence past the original context; an export writes
    the scaling back and transformers reads the same model from it."""
    src = save_hf("llama", tmp_path / "src", tok_dir, rope_scaling=dict(scaling))
    cfg = load_run_config(None, [*TRAIN, f"train.data={hf_data}"], model=str(src))
    assert cfg.model.rope_type == scaling["rope_type"]
    assert cfg.model.rope_factor == scaling["factor"]
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = atom_model(cfg, HFSource(src).getter(cfg.model))(x)[0]
        theirs = hf_model(src)(x).logits
        plain = replace(cfg, model={"rope_type": "default"})
        unscaled = atom_model(plain, HFSource(src).getter(plain.model))(x)[0]
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours - unscaled).abs().max().item() > 1e-3  # the scaling is exercised
    from atom.hf.export import _fresh_config

    written = _fresh_config(cfg.model, "llama", "fp32")  # a model trained from scratch
    folded = ("mscale", "mscale_all_dim")  # yarn: written as the attention factor they give
    assert {k: written["rope_scaling"][k] for k in scaling if k not in folded} == {
        k: v for k, v in scaling.items() if k not in folded
    }


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_checkpoints_give_transformers_logits(tmp_path, tok_dir, hf_data, family):
    """Mistral (and Qwen2 with every layer sliding) on a sequence twice the window: each
    token attends to the last 16; logits equal transformers' to fp32 precision, and differ
    from full causal attention (the window is exercised)."""
    extra = {"sliding_window": 16}
    if family == "qwen2":
        extra.update(use_sliding_window=True, max_window_layers=0)
    src = save_hf(family, tmp_path / "src", tok_dir, **extra)
    cfg = load_run_config(None, [*TRAIN, f"train.data={hf_data}"], model=str(src))
    assert cfg.model.sliding_window == 16 and cfg.model.seq_len == 32
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    windowed = atom_model(cfg, HFSource(src).getter(cfg.model))
    full = replace(cfg, model={"sliding_window": None})  # same weights, full causal attention
    params = dict(windowed.named_parameters())
    with torch.no_grad():
        ours = windowed(x)[0]
        theirs = hf_model(src)(x).logits
        unwindowed = atom_model(full, lambda name: params[name])(x)[0]
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours[:, 16:] - unwindowed[:, 16:]).abs().max().item() > 1e-3
    assert torch.allclose(ours[:, :16], unwindowed[:, :16], atol=1e-5)  # inside the window


def test_sliding_window_model_from_scratch_exports_as_mistral(tmp_path):
    from atom.hf.export import _family_of, _fresh_config
    from tests.conftest import tiny_config

    mc = tiny_config(model={"arch": "llama", "sliding_window": 8}).model
    assert _family_of(mc) == "mistral"
    c = _fresh_config(mc, "mistral", "fp32")
    assert c["architectures"] == ["MistralForCausalLM"] and c["sliding_window"] == 8
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**c))
    assert model.config.sliding_window == 8


def test_rope_scaling_set_on_a_checkpoint_is_exported(tmp_path, tok_dir, hf_data, capsys):
    """Context extension: a plain-RoPE Llama fine-tuned with --set model.rope_type=linear
    exports a config.json with that scaling (transformers then computes atom's logits);
    a changed sliding window is refused (the layers were trained with theirs)."""
    from atom.hf.export import _export_config

    src = save_hf("llama", tmp_path / "src", tok_dir)
    sets = [*TRAIN, f"train.data={hf_data}", "model.rope_type=linear", "model.rope_factor=2.0"]
    cfg = load_run_config(None, sets, model=str(src))
    written = _export_config(HFSource(src), cfg.model, "fp32")
    scaling = written.get("rope_parameters") or written.get("rope_scaling")
    assert scaling["rope_type"] == "linear" and scaling["factor"] == 2.0
    (tmp_path / "out").mkdir()
    for f in src.glob("*.safetensors*"):
        shutil.copy(f, tmp_path / "out" / f.name)
    (tmp_path / "out" / "config.json").write_text(json.dumps(written))
    x = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = atom_model(cfg, HFSource(src).getter(cfg.model))(x)[0]
        theirs = hf_model(tmp_path / "out")(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    mistral = save_hf("mistral", tmp_path / "m", tok_dir, sliding_window=16)
    code = main(["train", "--model", str(mistral), "--set", "model.sliding_window=8",
                 "--out", str(tmp_path / "run")])  # fmt: skip
    assert (
        code == 2 and "differs from the checkpoint's sliding_window=16" in capsys.readouterr().err
    )
