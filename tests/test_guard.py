"""A run never trains on, or saves, weights that diverged or were poisoned (atom/run/guard.py).

pytest tests/test_guard.py
"""

from __future__ import annotations

import pytest
import torch

from atom.cli import main
from atom.ground.errors import TrainingError
from atom.run.train import Trainer
from atom.store.checkpoint import list_checkpoints, load_checkpoint
from tests.conftest import tiny_config


def _poison_after(trainer: Trainer, step: int, value: float, whole: bool = False) -> None:
    """From `step` on, one weight of the engine's host master (or the whole first
    tensor) holds `value`: what a diverged update or a poisoned merge leaves."""
    real = trainer.engine.train_step
    calls = [0]

    def step_then_poison(batches, lr, stop=None):
        result = real(batches, lr, stop)
        calls[0] += 1
        if calls[0] >= step:
            name, weight = next(iter(trainer.engine.named_parameters().items()))
            if whole:
                weight.fill_(value)
            else:
                weight.view(-1)[0] = value
        return result

    trainer.engine.train_step = step_then_poison


@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_poisoned_weights_are_never_saved_and_the_run_stops(tmp_path, text_dataset, value):
    cfg = tiny_config(train={"max_steps": 6, "ckpt_interval": 2, "data": str(text_dataset)})
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    _poison_after(trainer, 3, value)
    with pytest.raises(TrainingError) as err:
        trainer.run()
    message = str(err.value)
    assert "\n" not in message and "not saved" in message and "step_00000002" in message
    # the step-2 checkpoint is the newest, whole and clean; nothing after it was written
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000002"]
    ckpt = load_checkpoint(tmp_path / "run")
    assert all(bool(torch.isfinite(ckpt.get(n)).all()) for n in ckpt.names())


def test_a_loss_that_stays_not_finite_stops_the_run(tmp_path, text_dataset):
    """Poisoned weights: every step's loss is NaN and the engine skips every update (a
    non-finite gradient norm); the run stops after three such steps, not at its end."""
    cfg = tiny_config(train={"max_steps": 6, "ckpt_interval": 0, "data": str(text_dataset)})
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    _poison_after(trainer, 1, float("inf"))  # the next forward's loss is not finite
    with pytest.raises(TrainingError, match=r"step [45]: the loss has not been finite for 3 steps"):
        trainer.run()


def test_the_cli_says_it_in_one_line_with_a_non_zero_exit(tmp_path, text_dataset, capsys):
    bad = ["train", "--out", str(tmp_path / "run"), "--no-progress",
           "--set", f"train.data={text_dataset}", "--set", "train.max_abs_weight=1e-6",
           "--set", "train.max_steps=2", "--set", "train.device=cpu"]  # fmt: skip
    assert main(bad) == 2  # every weight is above 1e-6: the first save is refused
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atom: error: step 2: weight ")
    assert list_checkpoints(tmp_path / "run") == []


def test_a_save_out_of_open_files_is_tried_again(tmp_path, text_dataset, monkeypatch):
    """EMFILE (a flood of gossip connections, shed by the server within seconds) fails one
    attempt, not the run; any other failure, or EMFILE every time, still ends it."""
    import errno

    import atom.run.train as train_module
    from atom.store.checkpoint import CheckpointError

    monkeypatch.setattr(train_module, "SAVE_RETRY_S", 0.0)
    cfg = tiny_config(train={"max_steps": 2, "data": str(text_dataset)})
    trainer = Trainer(cfg, out_dir=tmp_path / "run")
    real, failures = train_module.save_checkpoint, []

    def flaky(*args, **kwargs):
        if len(failures) < want_failures:
            failures.append(1)
            err = CheckpointError("could not save (Too many open files)")
            err.errno = errno.EMFILE
            raise err
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "save_checkpoint", flaky)
    want_failures = 2
    assert trainer.save(1).name == "step_00000001" and len(failures) == 2
    failures.clear()
    want_failures = train_module.SAVE_ATTEMPTS
    with pytest.raises(CheckpointError, match="open files"):
        trainer.save(2)
    assert len(list_checkpoints(tmp_path / "run")) == 1


def test_a_disk_full_for_a_while_does_not_end_the_run(tmp_path, text_dataset, monkeypatch, caplog):
    """Steps 3-6 find the disk full: their saves are skipped with a warning (the one on
    disk stays whole), their metrics records wait in memory and the file never holds half
    a line; once there is space the records are written in order and saving resumes. The
    run ends normally with one record per step (a full disk used to end it, leaving half
    a record in metrics.jsonl)."""
    import errno
    import json
    import os

    import atom.run.run_log as run_log_module
    import atom.run.train as train_module
    from atom.store.checkpoint import CheckpointError

    cfg = tiny_config(train={"max_steps": 8, "ckpt_interval": 2, "data": str(text_dataset)})
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    real_train, real_save, real_write = (
        trainer.engine.train_step,
        train_module.save_checkpoint,
        os.write,
    )
    full, step = [False], [0]

    def train_step(batches, lr, stop=None):
        step[0] += 1
        full[0] = 3 <= step[0] <= 6
        return real_train(batches, lr, stop)

    def write(fd, data):  # the disk takes a few bytes, then has no more
        if full[0]:
            real_write(fd, bytes(data[:7]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def save(*args, **kwargs):
        if full[0]:
            err = CheckpointError("could not save checkpoint (No space left on device)")
            err.errno = errno.ENOSPC
            raise err
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer.engine, "train_step", train_step)
    monkeypatch.setattr(train_module, "save_checkpoint", save)
    monkeypatch.setattr(run_log_module.os, "write", write)
    seen = []
    real_step = run_log_module.RunLog.step

    def step_and_look(self, record, postfix):
        real_step(self, record, postfix)
        seen.append((tmp_path / "run" / "metrics.jsonl").read_text())

    monkeypatch.setattr(run_log_module.RunLog, "step", step_and_look)
    try:
        with caplog.at_level("INFO", logger="atom"):
            summary = trainer.run()
    finally:
        trainer.close()
    assert summary.steps == 8
    assert caplog.text.count("no checkpoint:") == 1  # one line for the spell, not per save
    assert "saving again, after 2 saves skipped" in caplog.text
    for text in seen:  # never half a line, at any step
        assert text == "" or text.endswith("\n")
        [json.loads(line) for line in text.splitlines()]
    assert len(seen[4].splitlines()) == 2  # steps 3-5 held in memory
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [p.name for p in list_checkpoints(tmp_path / "run")][-1] == "step_00000008"
    assert "step_00000004" not in [p.name for p in list_checkpoints(tmp_path / "run")]


@pytest.mark.parametrize(("interval", "calls_made"), [(2, 12), (4, 14)], ids=["save", "loss"])
def test_a_passing_poisoning_is_rolled_back_and_the_run_goes_on(
    tmp_path, text_dataset, interval, calls_made
):
    """Weights poisoned once (a merge that slipped through): the next save refuses them (or
    three non-finite losses in a row would), the newest checkpoint is reloaded and
    training goes on from its step; the run ends normally with clean checkpoints and one
    record per step in metrics.jsonl."""
    import json

    cfg = tiny_config(train={"max_steps": 10, "ckpt_interval": interval, "data": str(text_dataset)})
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    real, calls = trainer.engine.train_step, [0]

    def poison_once(batches, lr, stop=None):
        result = real(batches, lr, stop)
        calls[0] += 1
        if calls[0] == 5:  # after step 5: the save at step 6 finds it (interval 2), or
            # steps 6, 7, 8 have NaN losses and the third rolls back to step 4 (interval 4)
            next(iter(trainer.engine.named_parameters().values())).view(-1)[0] = float("nan")
        return result

    trainer.engine.train_step = poison_once
    summary = trainer.run()
    assert summary.steps == 10 and calls[0] == calls_made
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").open()]
    assert steps == list(range(1, 11))
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.step == 10
    assert all(bool(torch.isfinite(ckpt.get(n)).all()) for n in ckpt.names())


def test_poisoning_that_persists_stops_after_two_rollbacks(tmp_path, text_dataset):
    cfg = tiny_config(train={"max_steps": 20, "ckpt_interval": 2, "data": str(text_dataset)})
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    _poison_after(trainer, 3, float("nan"))  # every step from the 3rd call on
    with pytest.raises(TrainingError, match="again after 2 rollback") as err:
        trainer.run()
    assert "\n" not in str(err.value) and "step_00000002" in str(err.value)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000002"]


def test_a_rollbacks_reload_is_not_cut_short_by_ctrl_c(capfd):
    """Ctrl+C during the reload is held off like during a save (half-restored weights
    would be saved by the interrupt handler); the message says what is under way."""
    import signal

    from atom.run.signals import Interrupts

    # Interrupts leaves SIGINT alone where it is not Python's default (a background job
    # ignores it): make it the default here, so the test runs there too
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Interrupts() as interrupts:
            with interrupts.saving("rolling back to the newest checkpoint"):
                signal.raise_signal(signal.SIGINT)  # its handler has run when this returns
                held = interrupts.pending and not interrupts.save_abandoned
            assert held
    finally:
        signal.signal(signal.SIGINT, before)
    assert "rolling back to the newest checkpoint; Ctrl+C 2 more" in capfd.readouterr().err
