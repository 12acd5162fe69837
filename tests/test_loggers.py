"""train.logger: csv, tensorboard and wandb beside metrics.jsonl.

pytest tests/test_loggers.py
"""

from __future__ import annotations

import csv
import json

import pytest

from atom.config import ConfigError
from atom.run.train import Trainer
from tests.conftest import tiny_config


def _jsonl(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_csv_has_a_row_per_step_and_resume_keeps_only_the_checkpointed_ones(tmp_path, text_dataset):
    cfg = tiny_config(train={"max_steps": 6, "eval_interval": 3, "ckpt_interval": 3,
                             "logger": "jsonl,csv", "data": str(text_dataset)})  # fmt: skip
    run = tmp_path / "run"
    Trainer(cfg, run, progress=False).run(max_steps=5)  # checkpoints at 3 and 5
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert [float(r["loss"]) for r in rows] == [r["loss"] for r in _jsonl(run)]
    assert rows[2]["val_loss"] and not rows[1]["val_loss"]
    from atom.store.checkpoint import list_checkpoints

    first = list_checkpoints(run)[0]  # resume from step 3: rows 4 and 5 are redone
    Trainer(cfg, run, resume=first, progress=False).run()
    with (run / "metrics.csv").open(newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_tensorboard_event_files_hold_the_metrics(tmp_path, text_dataset):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(train={"max_steps": 4, "eval_interval": 2, "logger": "tensorboard",
                             "data": str(text_dataset)})  # fmt: skip
    run = tmp_path / "run"
    Trainer(cfg, run, progress=False).run()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [round(e.value, 4) for e in loss] == [round(r["loss"], 4) for r in _jsonl(run)]
    assert [e.step for e in events.Scalars("val_loss")] == [2, 4]
    assert {"lr", "tokens_per_s", "device_peak_bytes"} <= set(events.Tags()["scalars"])


def test_a_logger_asked_for_but_not_installed_is_one_clear_line(tmp_path, monkeypatch):
    """Refused before the engine is built (weights loaded, peers joined): nothing to undo."""
    import sys

    import atom.run.train as train

    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it raises ImportError
    built = []
    monkeypatch.setattr(train, "build_engine", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match=r"needs wandb: pip install 'atom\[wandb\]'"):
        Trainer(tiny_config(train={"logger": "csv,wandb"}), tmp_path / "run", progress=False)
    assert not built
    with pytest.raises(ConfigError, match="train.logger: unknown 'mlflow'"):
        tiny_config(train={"logger": "csv,mlflow"})
