"""Configs: every file in configs/ loads and builds on the meta device; bad values refused.

pytest tests/test_config.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atom.config import CONFIG_DIR, Config, ConfigError, load_config
from atom.model import build_model, count_parameters

CONFIG_FILES = sorted(Path(CONFIG_DIR).glob("*.yaml"))
# published parameter counts (millions), to catch a wrong shape in a config file
EXPECTED_M = {
    "tiny": 0.84,
    "gpt2-124m": 124.4,
    "gpt3-350m": 355.9,
    "gpt3-1.3b": 1315.7,
    "gpt3-2.7b": 2651.6,
    "gpt3-6.7b": 6658.4,
    "llama-1b": 1100.0,
    "llama-7b": 6738.4,
    "llama-3.1-8b": 8030.3,  # Meta: 8.03B
    "llama-2-13b": 13015.9,  # Meta: 13.0B (Llama 2, table 1; 13,015,864,320 on the Hub)
    "codellama-34b": 33744.0,  # Meta: 33.7B (Code Llama 34B; 33,743,970,304 on the Hub)
    "llama-3.1-70b": 70553.7,  # Meta: 70.6B (70,553,706,496 on the Hub)
    "qwen2.5-7b": 7615.6,  # Qwen: 7.61B
}


def test_all_named_configs_are_present():
    assert {p.stem for p in CONFIG_FILES} == set(EXPECTED_M)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_loads_and_builds_on_meta(path):
    cfg = load_config(path)
    model = build_model(cfg.model)  # meta: no memory, even for 7B
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count_parameters(model) / 1e6 == pytest.approx(EXPECTED_M[path.stem], abs=0.1)
    logits, _ = model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    assert logits.shape == (1, 8, cfg.model.vocab_size)


def test_defaults_are_the_tiny_config():
    assert Config().to_dict() == load_config("tiny").to_dict() | {"train": Config().train.__dict__}


def test_overrides_type_themselves():
    cfg = load_config(None, ["train.lr=3e-4", "swap.checkpoint=false", "model.n_layer=2"])
    assert cfg.train.lr == 3e-4 and cfg.swap.checkpoint is False and cfg.model.n_layer == 2


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.d_model=100", "model.n_head=3"], "divisible"),
        (["swap.layers_per_unit=0"], "layers_per_unit"),
        (["swap.prefetch=9"], "prefetch"),
        (["train.lr=-1"], "lr"),
        (["model.arch=rnn"], "arch"),
        (["train.nope=1"], "unknown --set key train.nope"),
        (["trian.lr=1"], "did you mean 'train.lr'?"),
        (["trian.xyzzy=1"], "did you mean 'train'?"),
        # issue 42: a typo is answered with the whole key --set takes, not a bare 'lr'
        (["train.lrr=1"], "unknown --set key train.lrr; did you mean 'train.lr'?"),
        (["lr=1"], "got 'lr'; did you mean 'train.lr'?"),
        (["model.n_head"], "section.key=value"),
        (["model.n_layer=two"], "n_layer"),
    ],
)
def test_bad_values_are_one_line_errors(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {arch: gpt\n  n_layer: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model: {n_layers: 2}\n")
    with pytest.raises(ConfigError, match="did you mean 'model.n_layer'"):
        load_config(unknown)


def test_the_ground_floor_config_loader_leaves_hugging_face_to_the_run_loader(tmp_path):
    """atom.config knows nothing of Hugging Face (no import upward): a file naming a
    checkpoint is refused there in one line, and atom.run.run_config is what reads it."""
    from atom.config import ConfigError, load_config

    path = tmp_path / "ft.yaml"
    path.write_text("model: hf:/no/such/checkpoint\n")
    with pytest.raises(ConfigError, match="load_run_config"):
        load_config(path)


def test_rope_scaling_is_validated():
    from atom.config import ConfigError
    from tests.conftest import tiny_config

    llama = {"arch": "llama"}
    with pytest.raises(ConfigError, match="rope_type must be"):
        tiny_config(model={**llama, "rope_type": "dynamic"})
    with pytest.raises(ConfigError, match="yarn RoPE needs"):
        tiny_config(model={**llama, "rope_type": "yarn", "rope_beta_slow": 0.0})
    with pytest.raises(ConfigError, match="applies to arch llama"):
        tiny_config(model={"rope_type": "linear", "rope_factor": 2.0})
    with pytest.raises(ConfigError, match="rope_low_freq_factor < rope_high_freq_factor"):
        tiny_config(model={**llama, "rope_type": "llama3", "rope_low_freq_factor": 4.0})
    assert (
        tiny_config(model={**llama, "rope_type": "llama3", "rope_factor": 8.0}).model.rope_factor
        == 8
    )


def test_every_word_setting_refuses_a_typo_naming_the_choices():
    """Each setting typed Literal (a few words: model.arch, swap.state, gossip.codec, ...)
    is checked in one place: a typo, from a file or --set or in code, is refused in one
    line naming the section.key, every word it takes and the closest one."""
    import typing
    from dataclasses import fields

    from atom.config import ModelConfig, SwapConfig, TrainConfig
    from atom.config.choices import choices_of
    from atom.config.gossip import GossipConfig

    seen = []
    for section, cls in (("model", ModelConfig), ("train", TrainConfig), ("swap", SwapConfig),
                         ("gossip", GossipConfig)):  # fmt: skip
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            words = choices_of(hints[f.name])
            if not words:
                continue
            seen.append(f"{section}.{f.name}")
            typo = words[-1] + "x"
            with pytest.raises(ConfigError) as err:
                load_config(None, [f"{section}.{f.name}={typo}"])
            said = str(err.value)
            assert said.startswith(f"{section}.{f.name} must be {'|'.join(words)}, got ")
            assert said.endswith(f"did you mean {words[-1]!r}?") and "\n" not in said
            with pytest.raises(ValueError, match=f"{f.name} must be"):
                cls(**{f.name: typo})
    assert {"model.arch", "train.dtype", "swap.state", "swap.order", "gossip.codec"} <= set(seen)
