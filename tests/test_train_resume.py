"""Resume: an interrupted run continues exactly; a run killed while checkpointing always
leaves a checkpoint that loads and resumes.

    pytest tests/test_train_resume.py
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
import torch

from atom.config import load_config
from atom.run.train import Trainer
from atom.store.checkpoint import find_latest, load_checkpoint
from tests.conftest import tiny_config


def final_params(run_dir):
    ckpt = load_checkpoint(run_dir)
    return {n: ckpt.get(n) for n in ckpt.names() if not n.startswith("optim.")}


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.parametrize("resident", [False, True])
def test_resume_equals_uninterrupted(tmp_path, text_dataset, resident):
    cfg = tiny_config(
        train={"max_steps": 8, "grad_accum": 2, "data": str(text_dataset)},
        swap={"layers_per_unit": 1, "prefetch": 1},
    )
    Trainer(cfg, tmp_path / "full", resident=resident, progress=False).run()
    Trainer(cfg, tmp_path / "split", resident=resident, progress=False).run(max_steps=3)
    Trainer(
        cfg, tmp_path / "split", resident=resident, resume=tmp_path / "split", progress=False
    ).run()
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    full, split = final_params(tmp_path / "full"), final_params(tmp_path / "split")
    assert full.keys() == split.keys()
    for name in full:
        assert torch.equal(full[name], split[name]), name


@pytest.mark.parametrize("update", ["exact", "eager"])
def test_resume_from_a_mid_run_checkpoint_equals_uninterrupted(tmp_path, text_dataset, update):
    """Resume from a checkpoint taken in the middle of a run (not its last): the host
    worker may still hold that step's updates when the checkpoint is taken, and the
    optimizer's step count must be the one the tensors are saved at."""
    import shutil

    cfg = tiny_config(
        train={
            "max_steps": 9,
            "ckpt_interval": 3,
            "keep_checkpoints": 5,
            "data": str(text_dataset),
        },
        swap={"update": update},
    )
    Trainer(cfg, tmp_path / "full", progress=False).run()
    shutil.copytree(tmp_path / "full", tmp_path / "split")
    for later in ("step_00000006", "step_00000009"):
        shutil.rmtree(tmp_path / "split" / "checkpoints" / later)
    Trainer(cfg, tmp_path / "split", resume=tmp_path / "split", progress=False).run()
    assert losses(tmp_path / "split") == losses(tmp_path / "full")


def test_swapped_checkpoint_resumes_resident(tmp_path, text_dataset):
    """Checkpoints are keyed by parameter name, not by unit: either engine reads either."""
    cfg = tiny_config(train={"max_steps": 6, "data": str(text_dataset)})
    Trainer(cfg, tmp_path / "a", progress=False).run(max_steps=3)
    Trainer(cfg, tmp_path / "a", resident=True, resume=tmp_path / "a", progress=False).run()
    Trainer(cfg, tmp_path / "b", progress=False).run()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == len(b) == 6
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) / y < 1e-5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_while_checkpointing_always_leaves_a_resumable_checkpoint(tmp_path, text_dataset):
    run = tmp_path / "run"
    overrides = [
        f"train.data={text_dataset}",
        "train.ckpt_interval=1",
        "train.keep_checkpoints=2",
        "train.max_steps=100000",
        "model.n_layer=2",
        "model.seq_len=32",
        "train.eval_interval=0",
    ]
    argv = [sys.executable, "-m", "atom.cli", "train", "--out", str(run), "--no-progress"]
    for item in overrides:
        argv += ["--set", item]
    cfg = load_config(None, overrides)
    rng = random.Random(7)
    last_step = 0
    for round_ in range(8):
        resume = ["--resume", str(run)] if round_ else []
        child = subprocess.Popen(
            argv + resume, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 60
            # wait until this process has written a checkpoint past the last one we saw
            while time.monotonic() < deadline:
                steps = (
                    [int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")]
                    if (run / "checkpoints").exists()
                    else []
                )
                if steps and max(steps) > last_step:
                    break
                assert child.poll() is None, "trainer exited early"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.05))  # a checkpoint is written every few ms
        finally:
            child.kill()
            child.wait(timeout=30)
        latest = find_latest(run)
        ckpt = load_checkpoint(latest)  # verifies sizes and hashes
        assert ckpt.step >= last_step
        last_step = ckpt.step
        # and it resumes: the engine restores from it without complaint
        trainer = Trainer(cfg, tmp_path / f"probe{round_}", resume=latest, progress=False)
        assert trainer.start_step == ckpt.step
        trainer.engine.close()
    assert last_step > 1


@pytest.mark.parametrize("presses", [2, 3])
def test_ctrl_c_during_a_checkpoint_save(tmp_path, text_dataset, monkeypatch, presses):
    """Ctrl+C pressed while a checkpoint is being written: twice, the save finishes and
    the run stops right after it (no second save); three times, the save is abandoned,
    the half-written directory removed, the previous checkpoint kept, and the trainer
    reports no new checkpoint."""
    import os
    import signal

    import atom.store.checkpoint as checkpoint

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default here (a background job ignores it)")
    cfg = tiny_config(
        train={"max_steps": 8, "ckpt_interval": 2, "data": str(text_dataset)},
        model={"n_layer": 2},
    )
    real, files = checkpoint.save_file, [0]

    def save_file(tensors, path):
        files[0] += 1
        if files[0] == 6:  # the second checkpoint (4 unit files each), half-way through
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
        return real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    if presses == 2:
        assert saved == ["step_00000002", "step_00000004"]
        assert trainer.interrupt_checkpoint.name == "step_00000004"
        assert len(losses(tmp_path / "run")) == 4  # stopped right after the save
    else:
        assert saved == ["step_00000002"]  # nothing half-written left beside it
        assert trainer.interrupt_checkpoint is None
    assert files[0] == 8 if presses == 2 else files[0] == 6


@pytest.mark.parametrize("update", ["exact", "eager"])
def test_a_second_ctrl_c_while_a_step_updates_lets_the_step_finish(tmp_path, text_dataset, update):
    """Two presses while the step applies its unit updates (on the CPU they run on the
    training thread): cut there, the weights would hold half a step, saved as the step
    before it. The step finishes, is saved, and the run stops: its checkpoint equals an
    unbroken run's at that step."""
    import os
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default here (a background job ignores it)")
    cfg = tiny_config(
        train={
            "max_steps": 6,
            "ckpt_interval": 0,
            "eval_interval": 0,
            "data": str(text_dataset),
        },
        model={"n_layer": 3},
        swap={"layers_per_unit": 1, "update": update},
    )
    Trainer(cfg, tmp_path / "full", progress=False).run(max_steps=3)
    trainer = Trainer(cfg, tmp_path / "cut", progress=False)
    engine = trainer.engine
    real, calls = engine._update, [0]

    def update_unit(u, coef, lr):
        calls[0] += 1
        if calls[0] == 2 * len(engine.units) + 2:  # step 3, its second unit update
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)  # handled before kill returns
        return real(u, coef, lr)

    engine._update = update_unit
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert trainer.interrupt_checkpoint.name == "step_00000003"
    assert calls[0] == 3 * len(engine.units)  # every unit of step 3 updated, none after
    full, cut = final_params(tmp_path / "full"), final_params(tmp_path / "cut")
    for name in full:
        assert torch.equal(full[name], cut[name]), name


def _two_presses() -> None:
    import os
    import signal

    for _ in range(2):
        os.kill(os.getpid(), signal.SIGINT)  # handled before kill returns


def _step_cfg(text_dataset):
    return tiny_config(
        train={"max_steps": 6, "eval_interval": 3, "ckpt_interval": 0,
               "data": str(text_dataset)},
        model={"n_layer": 2},
    )  # fmt: skip


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, text_dataset):
    """An unbroken run's checkpoint at step 3, and its whole run to step 6."""
    root = tmp_path_factory.mktemp("unbroken")
    cfg = _step_cfg(text_dataset)
    Trainer(cfg, root / "three", progress=False).run(max_steps=3)
    Trainer(cfg, root / "whole", progress=False).run()
    return root / "three", root / "whole"


# after `engine.train_step` returns, what the loop calls before the step's record is whole
AFTER_THE_STEP = ["perf_counter", "record", "guard", "evaluate", "log", "log_written"]


@pytest.mark.parametrize("point", AFTER_THE_STEP)
def test_a_second_ctrl_c_after_a_step_saves_it_under_its_own_label(
    tmp_path, text_dataset, unbroken, monkeypatch, point
):
    """issue 42: the step's weights land at `engine.train_step`, but it was counted only
    after evaluation and logging; two presses in between saved step 3's weights as
    step_00000002 (optimizer_steps 3) and --resume trained step 3's batch again. At every
    point after the step returns, the checkpoint is step 3's: label, weights and
    optimizer_steps agree with an unbroken run's, and a resume ends where it does."""
    import signal
    import time as real_time
    from types import SimpleNamespace

    import atom.run.train
    from atom.run.guard import LossWatch
    from atom.run.run_log import RunLog

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default here (a background job ignores it)")
    cfg = _step_cfg(text_dataset)
    trainer = Trainer(cfg, tmp_path / "cut", progress=False)
    engine, real_step, stepped, fired = trainer.engine, trainer.engine.train_step, [0], []

    def train_step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        stepped[0] += 1
        return result

    def hooked(name, real):
        def call(*args, **kwargs):
            if point == name and stepped[0] == 3 and not fired:
                fired.append(name)
                _two_presses()
            return real(*args, **kwargs)

        return call

    def written(*args, **kwargs):  # the record is in the file; loggers and bar are not
        out = real_write(*args, **kwargs)
        if point == "log_written" and stepped[0] == 3 and not fired:
            fired.append(point)
            _two_presses()
        return out

    engine.train_step = train_step
    clock = SimpleNamespace(perf_counter=hooked("perf_counter", real_time.perf_counter),
                            monotonic=real_time.monotonic, sleep=real_time.sleep)  # fmt: skip
    monkeypatch.setattr(atom.run.train, "time", clock)
    monkeypatch.setattr(Trainer, "_record", hooked("record", Trainer._record))
    monkeypatch.setattr(LossWatch, "see", hooked("guard", LossWatch.see))
    monkeypatch.setattr(Trainer, "evaluate", hooked("evaluate", Trainer.evaluate))
    monkeypatch.setattr(RunLog, "step", hooked("log", RunLog.step))
    real_write = RunLog._write
    monkeypatch.setattr(RunLog, "_write", written)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert fired == [point]
    saved = trainer.interrupt_checkpoint
    three, whole = unbroken
    assert saved is not None and saved.name == "step_00000003"
    assert load_checkpoint(saved).meta["optimizer_steps"] == 3
    want = final_params(three)
    for name, value in final_params(saved).items():
        assert torch.equal(value, want[name]), name
    assert [json.loads(line)["step"] for line in
            (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]  # fmt: skip
    # the hooks have fired: they pass through from here
    Trainer(cfg, tmp_path / "cut", resume=tmp_path / "cut", progress=False).run()
    assert losses(tmp_path / "cut") == losses(whole)
    want = final_params(whole)
    for name, value in final_params(tmp_path / "cut").items():
        assert torch.equal(value, want[name]), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_inside_a_long_step_is_honoured_within_seconds(tmp_path, text_dataset):
    """A step that takes many seconds (long context on the CPU) is abandoned between unit
    visits a couple of seconds after Ctrl+C, and the last finished step is saved."""
    import os
    import signal

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "atom.cli", "train", "--no-progress", "--out", str(out),
           "--max-steps", "5", "--set", f"train.data={text_dataset}",
           "--set", "model.n_layer=8", "--set", "model.d_model=256", "--set", "model.n_head=4",
           "--set", "model.seq_len=2048", "--set", "model.vocab_size=256",
           "--set", "train.micro_batch=8", "--set", "train.eval_interval=0"]  # fmt: skip

    def default_sigint():
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=default_sigint)  # fmt: skip
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        step_s = json.loads(metrics.read_text().splitlines()[0])["step_time_s"]
        assert step_s > 5, f"the step ({step_s:.1f} s) is too short to show anything"
        time.sleep(0.5)  # into step 2
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        output = proc.communicate(timeout=120)[0]
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, output
    assert waited < step_s / 2 + 3, (waited, step_s)  # not the rest of the step
    assert "checkpoint saved" in output and "step_00000001" in output
    assert len(metrics.read_text().splitlines()) == 1


def test_a_step_of_minutes_is_said_before_it_starts(tmp_path, text_dataset, monkeypatch, caplog):
    """A run whose step the machine will take minutes over says so up front (FLOPs over
    this device's measured matmul rate), and a quick one does not."""
    import logging

    import atom.run.train as train

    cfg = tiny_config(train={"max_steps": 1, "data": str(text_dataset)})
    quick = Trainer(cfg, tmp_path / "a", progress=False)
    assert quick.estimated_step_s() < 1
    with caplog.at_level(logging.WARNING, logger="atom.run.train"):
        quick.run()
    assert "each step will take" not in caplog.text
    monkeypatch.setattr(train, "_matmul_flops", lambda device, dtype: 1e3)  # a slow machine
    slow = Trainer(cfg, tmp_path / "b", progress=False)
    assert slow.estimated_step_s() > 60
    with caplog.at_level(logging.WARNING, logger="atom.run.train"):
        slow.run()
    assert (
        "each step will take about" in caplog.text and "Ctrl+C stops within seconds" in caplog.text
    )


def test_validation_loss_is_said_as_it_is_measured(tmp_path, text_dataset, caplog):
    import logging

    cfg = tiny_config(
        train={"max_steps": 6, "eval_interval": 3, "log_interval": 5, "data": str(text_dataset)}
    )
    with caplog.at_level(logging.INFO, logger="atom"):
        Trainer(cfg, tmp_path / "run", progress=False).run()
    said = [r.getMessage() for r in caplog.records if "val loss" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["step 3", "step 6"]
    assert "perplexity" in said[0] and "train loss" in said[0]


def test_a_resumed_optimizer_step_count_sits_where_its_kernel_reads_it():
    """Fused and capturable AdamW read `step` on the parameter's device (the fused CUDA
    kernel refuses a CPU one: a resumed --resident run on a GPU crashed at its first
    step). Where torch's own load_state_dict puts it, init_state must too. Capturable on
    meta params stands in for a device the CPU is not (fused is built for cpu/cuda only,
    and on the CPU it could not fail); tests/test_gpu.py resumes on CUDA itself."""
    from atom.optim import init_state

    kind, device = "capturable", "meta"
    p = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = torch.optim.AdamW([p], **{kind: True})
    state = init_state(opt, p, 7)
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, device=device))], **{kind: True})
    theirs.load_state_dict({"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(4),
                                          "exp_avg_sq": torch.zeros(4)}},
                            "param_groups": theirs.state_dict()["param_groups"]})  # fmt: skip
    want = next(iter(theirs.state.values()))["step"]
    assert state["step"].device == want.device == p.device
    assert state["step"].dtype == want.dtype == torch.float32


def test_a_setup_that_fails_releases_what_it_built(tmp_path, text_dataset, monkeypatch):
    """Joining peers failed after the engine was built: the engine (its pinned memory, its
    threads) was left for the garbage collector; every resource is now released on one
    path, whatever fails."""
    import atom.run.train as train
    from atom.gossip.averager import GossipError

    closed, real = [], train.build_engine

    def build(*args, **kwargs):
        engine = real(*args, **kwargs)
        close = engine.close
        engine.close = lambda: (closed.append(1), close())
        return engine

    monkeypatch.setattr(train, "build_engine", build)
    cfg = tiny_config(train={"data": str(text_dataset)},
                      gossip={"listen": "tcp://127.0.0.1:0", "join": "tcp://127.0.0.1:9",
                              "join_timeout_s": 1.0})  # fmt: skip
    with pytest.raises(GossipError, match="nothing listens at tcp://127.0.0.1:9"):
        Trainer(cfg, tmp_path / "run")
    assert closed == [1]


def test_ctrl_c_before_the_first_step_releases_everything(tmp_path, text_dataset, monkeypatch):
    """A SIGTERM a second after joining (the soak's term_restart) arrived while run() set
    up its metrics file: nothing closed the peers until atexit, where their server threads
    met pyzmq's own shutdown ("zmq gc socket requested during shutdown", a traceback)."""
    cfg = tiny_config(train={"data": str(text_dataset)})
    trainer = Trainer(cfg, tmp_path / "run")
    closed, close = [], trainer.close
    monkeypatch.setattr(trainer, "close", lambda: (closed.append(1), close()))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("atom.run.train.RunLog", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert closed
