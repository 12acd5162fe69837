"""Shared fixtures: tiny configs, a small prepared dataset, child-process cleanup."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import psutil
import pytest
import torch

from atom.config import Config
from atom.data.tokens import prepare

torch.set_flush_denormal(True)  # denormals slow CPU backward ~10x (FIELD_NOTES.md)

WORDS = (
    "the model streams units through the device while peers average their weights "
    "and a small corpus is all a test needs to see the loss fall"
).split()


def tiny_config(**sections) -> Config:
    """A model small enough for a CPU step in milliseconds; sections override defaults."""
    data = {
        "model": {
            "arch": "gpt",
            "n_layer": 3,
            "n_head": 4,
            "d_model": 64,
            "seq_len": 32,
            "vocab_size": 256,
        },
        "train": {
            "micro_batch": 4,
            "grad_accum": 1,
            "max_steps": 5,
            "warmup_steps": 2,
            "eval_interval": 0,
            "eval_batches": 2,
            "ckpt_interval": 0,
            "device": "cpu",
            "dtype": "fp32",
        },
        "swap": {"layers_per_unit": 1, "prefetch": 1},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return Config.from_dict(data)


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory) -> Path:
    """A byte-level dataset of generated text (no third-party text, no download)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(3000)]
    src = root / "corpus.txt"
    src.write_text("\n".join(lines))
    out = root / "data"
    prepare([src], out, progress=False)
    return out


@pytest.fixture(autouse=True)
def no_leftover_children():
    """Kill any child process a test leaves behind."""
    yield
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=5)
        except (psutil.Error, OSError):
            pass


@pytest.fixture(autouse=True)
def own_working_directory(tmp_path_factory, monkeypatch):
    """Each test runs in a directory it owns: the CLI's defaults (runs/default, plan.json,
    data/) land there, so what a user left in the checkout (the README's first command
    writes runs/default) cannot change a test's outcome."""
    work = tmp_path_factory.mktemp("cwd")  # beside tmp_path, which stays the test's own
    monkeypatch.chdir(work)
    # and an environment of its own: a command run in-process (gpu_check's main sets its
    # deadline in os.environ) must not cut a later test's child short
    environ = dict(os.environ)
    yield work
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def unbudgeted(monkeypatch):
    """Exchanges of one unit back to back, as fast as a test makes them: the serve budget
    (atom/gossip/budget.py) answers `busy` past a few a window, by design; a test of an
    exchange's mechanics (codecs, references) lifts it."""
    from atom.gossip import budget

    for name in ("PER_SENDER", "PER_UNIT"):
        monkeypatch.setattr(budget, name, 10**9)
    monkeypatch.setattr(budget, "MOVE", float("inf"))
