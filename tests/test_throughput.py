"""tokens/s as it is shown: the summary's is tokens over wall time (and over the steps' own
time beside it), the log lines' and the bar's over the last half minute of wall time.

    pytest tests/test_throughput.py
"""

from __future__ import annotations

import logging
import time

import pytest

from atom.run.run_log import RecentRate
from atom.run.train import Trainer
from tests.conftest import tiny_config


def test_the_summary_rate_is_tokens_over_wall_time(monkeypatch, tmp_path, text_dataset):
    """issue 42: the summary averaged per-step rates (4,726 tokens/s for a run whose
    tokens over step time were 720); with evaluations between steps that mean ran far
    above what the run did. Here evaluation takes most of the wall time. The wall time is
    the training loop's (from its start to the run's end): setup (the engine, the data)
    is not training, and on a loaded machine it is most of a run this short."""
    cfg = tiny_config(
        train={"max_steps": 12, "eval_interval": 2, "eval_batches": 40,
               "data": str(text_dataset)},
        model={"n_layer": 2},
    )  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    started = []
    loop = Trainer._loop

    def timed_loop(self, *args):
        started.append(time.perf_counter())
        return loop(self, *args)

    monkeypatch.setattr(Trainer, "_loop", timed_loop)
    summary = trainer.run()
    wall = time.perf_counter() - started[0]
    tokens = 12 * 4 * 32
    assert summary.tokens_per_s == pytest.approx(tokens / wall, rel=0.05)
    assert summary.tokens == tokens
    step_time = sum(r["step_time_s"] for r in summary.history)
    assert summary.step_tokens_per_s == pytest.approx(tokens / step_time, rel=1e-6)


def test_the_terminal_rate_is_smoothed_over_wall_time(monkeypatch, tmp_path, caplog):
    """Three steps of a second each, then one of 10 ms: the log line says ~1.3x the
    slow steps' rate (tokens over the window's wall time), not the last step's 100x."""
    from atom.run import run_log

    clock = [0.0]
    monkeypatch.setattr(run_log.time, "perf_counter", lambda: clock[0])
    rate = RecentRate(tokens_per_step=100)
    for t in (1.0, 2.0, 3.0):
        clock[0] = t
        assert rate.step() == pytest.approx(100.0)
    clock[0] = 3.01
    assert rate.step() == pytest.approx(400 / 3.01)
    clock[0] = 100.0  # a minute later: only the window's steps count
    assert rate.step() == pytest.approx(100 / (100.0 - 3.01))

    clock[0] = 0.0
    log = run_log.RunLog(tmp_path, 0, 2, False, [], 1, tokens_per_step=100)
    record = {"lr": 1e-3, "device_peak_bytes": 0, "step_time_s": 1.0}
    with caplog.at_level(logging.INFO, logger="atom.run.run_log"):
        clock[0] = 1.0
        log.step({**record, "step": 1, "loss": 2.0, "tokens_per_s": 100.0}, {})
        clock[0] = 1.01
        log.step({**record, "step": 2, "loss": 2.0, "tokens_per_s": 10_000.0}, {})
    log.close()
    assert "step 2/2 loss 2.0000 lr 1.00e-03 198 tokens/s" in caplog.text


def test_log_lines_without_a_terminal_say_elapsed_time_and_eta(monkeypatch, tmp_path, caplog):
    """issue 42: with no terminal (no bar) the log lines had no elapsed time or ETA. Steps
    a second apart, 10 planned: at step 2, 2 s in, 8 steps left at the window's rate."""
    from atom.run import run_log

    clock = [0.0]
    monkeypatch.setattr(run_log.time, "perf_counter", lambda: clock[0])
    log = run_log.RunLog(tmp_path, 0, 10, False, [], 2, tokens_per_step=100)
    record = {"lr": 1e-3, "device_peak_bytes": 0, "step_time_s": 1.0, "loss": 2.0}
    with caplog.at_level(logging.INFO, logger="atom.run.run_log"):
        for step in (1, 2):
            clock[0] = float(step)
            log.step({**record, "step": step, "tokens_per_s": 100.0}, {})
    log.close()
    assert caplog.text.rstrip().endswith("step 2/10 loss 2.0000 lr 1.00e-03 100 tokens/s "
                                         "device 0B elapsed 00:02 ETA 00:08")  # fmt: skip
