"""The `atom` command line: bad input is one line and exit 2; the default run trains.

pytest tests/test_cli.py
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atom.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def run_dir(tmp_path, text_dataset, capsys):
    """A finished 2-step run with a checkpoint."""
    out = tmp_path / "run"
    code, _, _ = run_cli(
        capsys,
        "train",
        "--set",
        "model.n_layer=2",
        "--set",
        "model.seq_len=32",
        "--set",
        f"train.data={text_dataset}",
        "--max-steps",
        "2",
        "--out",
        str(out),
        "--no-progress",
    )
    assert code == 0
    return out


def corrupt(run_dir):
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    victim = ckpt / "unit_001.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return ckpt


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--config", "no/such.yaml"], "config file not found"),
        (["train", "--set", "model.d_model=100", "--set", "model.n_head=3"], "divisible by"),
        (["train", "--set", "swap.layers_per_unit=0"], "layers_per_unit must be >= 1"),
        (
            ["train", "--set", "swap.prefetch=50"],
            "prefetch (50) is larger than the number of units",
        ),
        (["train", "--set", "train.bogus=1"], "unknown --set key train.bogus"),
        (["train", "--set", "train.data=/no/such/dir"], "/no/such/dir"),
        (["train", "--resume", "/no/such/run"], "no checkpoint"),
        (["train", "--max-steps", "0"], "--max-steps"),
        (["prepare", "/no/such/file.txt", "--out", "/tmp/x"], "/no/such/file.txt"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atom: error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_bad_yaml_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  arch: gpt\n   n_layer: 2\n")
    code, _, err = run_cli(capsys, "train", "--config", str(bad))
    assert code == 2 and "not valid YAML" in err and len(err.strip().splitlines()) == 1


def test_corrupt_checkpoint_refused_and_kept(run_dir, capsys):
    ckpt = corrupt(run_dir)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    code, _, err = run_cli(capsys, "train", "--resume", str(ckpt), "--out", str(run_dir))
    assert code == 2 and "corrupt" in err and len(err.strip().splitlines()) == 1
    # refused, and not overwritten or deleted
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_mismatched_checkpoint_refused(run_dir, text_dataset, capsys):
    code, _, err = run_cli(
        capsys,
        "train",
        "--resume",
        str(run_dir),
        "--out",
        str(run_dir),
        "--set",
        "model.n_layer=3",
        "--set",
        f"train.data={text_dataset}",
    )
    assert code == 2 and "different model config" in err


def test_metrics_have_the_promised_fields(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("step", "loss", "lr", "tokens_per_s", "step_time_s", "device_peak_bytes"):
            assert key in r
        assert r["device_peak_bytes"] > 0
    assert "val_loss" in records[-1]


def test_generate_from_checkpoint(run_dir, capsys):
    code, out, _ = run_cli(capsys, "generate", str(run_dir), "--prompt", "the ", "--tokens", "20")
    assert code == 0 and out.startswith("the ") and len(out.encode()) >= 20


@pytest.mark.slow
def test_default_run_in_a_fresh_process_drops_the_loss(tmp_path):
    """`atom train` with no config: built-in tiny model on the stdlib corpus."""
    env = dict(os.environ, ATOM_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "atom.cli", "train", "--max-steps", "40", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # from ~5.5 (uniform over 256 bytes)


def test_bad_input_in_a_fresh_process_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "atom.cli", "train", "--set", "swap.prefetch=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["atom: error: swap.prefetch must be >= 0, got -1"]


def test_a_model_too_big_for_host_ram_is_refused_up_front(capsys):
    code, _, err = run_cli(
        capsys,
        "train",
        "--config",
        "llama-7b",
        "--set",
        "model.n_layer=2000",
        "--set",
        "train.device=cpu",
    )
    assert code == 2
    assert "GiB of host RAM" in err and "available" in err


def _default_sigint() -> None:
    # a pytest run as a shell's background job ignores SIGINT, and children inherit that
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_stop_signal_saves_a_checkpoint_and_exits_130(tmp_path, text_dataset, sig):
    """docker stop / kill (SIGTERM) and Ctrl+C (SIGINT) both stop at a step boundary
    with a checkpoint of the last finished step."""
    import signal
    import time

    from atom.store.checkpoint import load_checkpoint

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "atom.cli", "train", "--no-progress", "--out", str(out),
           "--max-steps", "100000", "--set", "model.n_layer=2", "--set", "model.seq_len=32",
           "--set", f"train.data={text_dataset}", "--set", "train.eval_interval=0"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=_default_sigint)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(getattr(signal, sig))
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, output
    assert "Traceback" not in output
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    latest = max((out / "checkpoints").glob("step_*"))
    assert load_checkpoint(latest).meta["step"] == steps[-1]


def test_ctrl_c_before_training_is_one_line_exit_130(monkeypatch, capsys):
    """Ctrl+C while profiling or joining peers: no traceback, exit 130."""
    import atom.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(atom.cli, "cmd_profile", interrupted)
    code, out, err = run_cli(capsys, "profile")
    assert code == 130
    assert err.strip() == "atom profile: interrupted"


def test_resume_without_out_continues_in_the_resumed_run(run_dir, capsys, tmp_path, monkeypatch):
    """`--resume runs/a` (no --out) used to write into runs/default; it continues runs/a."""
    monkeypatch.chdir(tmp_path)  # where runs/default would land
    sets = ["--set", "model.n_layer=2", "--set", "model.seq_len=32",
            "--set", f"train.data={_data_of(run_dir)}"]  # fmt: skip
    code, _, _ = run_cli(
        capsys, "train", "--resume", str(run_dir), "--max-steps", "3", "--no-progress", *sets
    )
    assert code == 0
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]
    assert not (tmp_path / "runs").exists()


def _data_of(run_dir):
    return json.loads((run_dir / "config.json").read_text())["train"]["data"]


def test_a_new_run_refuses_a_directory_holding_another(run_dir, capsys):
    before = (run_dir / "metrics.jsonl").read_bytes()
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    code, _, err = run_cli(capsys, "train", "--out", str(run_dir), "--max-steps", "1",
                           "--set", "model.n_layer=3", "--no-progress",
                           "--set", f"train.data={_data_of(run_dir)}")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "already holds a run" in err and f"--resume {run_dir}" in err
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # nothing truncated
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ckpts


def test_version_and_bad_generate_arguments(run_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("atom ")
    code, _, err = run_cli(capsys, "generate", str(run_dir), "--tokens", "-3")
    assert code == 2 and "--tokens" in err and len(err.strip().splitlines()) == 1


def test_the_command_line_starts_without_torch():
    """`atom peers`, `atom keygen` and `--help` need no model: importing the CLI must not
    import torch (it took 2.5-6 s before `atom peers` could print a table)."""
    probe = "import sys, atom.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _lrs(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


def test_resume_continues_with_the_saved_config_and_names_each_change(run_dir, capsys):
    """No --set model.* to repeat; a train.* value named on the command line is applied
    and said; a changed model or data is refused in one line."""
    code, out, _ = run_cli(capsys, "train", "--resume", str(run_dir), "--max-steps", "3",
                           "--set", "train.lr=0.002", "--no-progress")  # fmt: skip
    assert code == 0
    assert "atom: resuming with train.lr: 0.001 -> 0.002" in out
    assert _lrs(run_dir)[3] == pytest.approx(0.002 * 3 / 21)  # step 3 of a 20-step warm-up
    for sets, needle in (
        (["--set", "model.d_model=64"], "different model config (model.d_model 128, not 64)"),
        (["--set", "train.data=/tmp"], "different data"),
        (["--config", "tiny"], "drop --config"),
    ):
        code, _, err = run_cli(capsys, "train", "--resume", str(run_dir), *sets, "--no-progress")
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_extending_a_finished_run_does_not_jump_the_lr(tmp_path, text_dataset, capsys):
    """A run planned for 6 steps, extended to 10: the LR after step 6 stays at the decayed
    min_lr (it used to jump back up a cosine re-fitted to 10 steps)."""
    out = tmp_path / "run"
    sets = ["--set", "model.n_layer=2", "--set", "model.seq_len=32", "--set",
            f"train.data={text_dataset}", "--set", "train.warmup_steps=1"]  # fmt: skip
    assert run_cli(capsys, "train", *sets, "--max-steps", "6", "--out", str(out),
                   "--no-progress")[0] == 0  # fmt: skip
    code, said, _ = run_cli(capsys, "train", "--resume", str(out), "--max-steps", "10",
                            "--no-progress")  # fmt: skip
    assert code == 0 and "keeps its planned decay over 6 steps" in said
    lrs = _lrs(out)
    assert lrs[7] <= lrs[6] + 1e-12 and all(lrs[s] == lrs[7] for s in range(7, 11))


@pytest.mark.parametrize(
    "field,value",
    [("rng", {"torch": "not base64 !!"}), ("rng", {"torch": "AAAA"}), ("clip", {"eager_coef": "x"}),
     ("optimizer_steps", "many")],
    ids=["rng-garbage", "rng-short", "clip", "steps"],
)  # fmt: skip
def test_corrupt_state_in_meta_is_one_line(run_dir, capsys, field, value):
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    meta = json.loads((ckpt / "meta.json").read_text())
    meta[field] = value
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_cli(capsys, "train", "--resume", str(run_dir), "--max-steps", "4",
                           "--no-progress")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "corrupt state in meta.json" in err and str(ckpt) in err


@pytest.mark.parametrize("err_no", [errno.ENOSPC, errno.EMFILE])
def test_a_save_the_system_refuses_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path, text_dataset, capsys, monkeypatch, err_no
):
    """Disk full (or out of file handles) at the second checkpoint: one line naming the
    cause, the fix and the checkpoint that is still there; nothing half-written left."""
    import atom.store.checkpoint as checkpoint

    real, calls = checkpoint.save_file, [0]

    def save_file(tensors, path):
        calls[0] += 1
        if calls[0] > 4:  # the first checkpoint (4 unit files) goes through
            raise OSError(err_no, os.strerror(err_no), path)
        return real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--set", "model.n_layer=2", "--set",
                           f"train.data={text_dataset}", "--set", "train.ckpt_interval=2",
                           "--max-steps", "4", "--out", str(out), "--no-progress")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    first = out / "checkpoints" / "step_00000002"
    assert os.strerror(err_no) in err and f"previous checkpoint {first} is intact" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_run_that_does_not_use_deepspeed_does_not_import_it(tmp_path):
    """DeepSpeed prints an accelerator warning on import and takes seconds: only
    train.optimizer=deepspeed may load it."""
    code = (
        "import sys; from atom.cli import main; "
        f"assert main(['train', '--max-steps', '1', '--out', {str(tmp_path / 'r')!r}, "
        "'--no-progress', '--set', 'model.n_layer=1']) == 0; "
        "assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_resume_names_each_max_steps_change_once():
    from atom.run.run_config import resume_changes, resume_run_config
    from tests.conftest import tiny_config

    saved = tiny_config(train={"max_steps": 300}).to_dict()

    def said(*sets, max_steps=None):
        return resume_changes(saved, resume_run_config(saved, list(sets), max_steps))

    assert said(max_steps=600) == [
        "train.max_steps: 300 -> 600; the LR keeps its planned decay over 300 steps and "
        "stays at min_lr after it (--set train.lr_decay_steps=N plans another)"
    ]
    assert said(max_steps=100) == [
        "train.max_steps: 300 -> 100; the LR keeps its planned decay over 300 steps and "
        "stops at step 100, above min_lr (--set train.lr_decay_steps=N plans another)"
    ]
    assert said("train.lr_decay_steps=1000") == ["train.lr_decay_steps: None -> 1000"]
    assert said() == []


def test_plot_writes_a_png_of_several_runs(run_dir, tmp_path, text_dataset, capsys):
    """`atom plot` overlays runs (train curve and val points) on steps, tokens or time."""
    pytest.importorskip("matplotlib")
    other = tmp_path / "other"
    assert run_cli(capsys, "train", "--set", "model.n_layer=2", "--set", "model.seq_len=32",
                   "--set", f"train.data={text_dataset}", "--set", "train.eval_interval=1",
                   "--max-steps", "3", "--out", str(other), "--no-progress")[0] == 0  # fmt: skip
    for x in ("step", "tokens", "time"):
        png = tmp_path / f"curves-{x}.png"
        code, out, _ = run_cli(capsys, "plot", str(run_dir), str(other), "--x", x,
                               "--out", str(png))  # fmt: skip
        assert code == 0 and str(png) in out
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert run_cli(capsys, "plot", str(run_dir))[0] == 0
    assert (run_dir / "loss.png").is_file()  # the default: beside the first run
    code, _, err = run_cli(capsys, "plot", str(tmp_path / "nothing"))
    assert code == 2 and "holds no metrics.jsonl" in err


def test_eval_scores_every_token_of_a_file_as_plain_pytorch_does(run_dir, tmp_path, capsys):
    """`atom eval RUN --data FILE`: the run's tokenizer, consecutive windows of seq_len+1,
    the swapped engine; loss equals the model evaluated directly in plain PyTorch on the
    same windows, perplexity is exp(loss)."""
    import math

    import torch

    from atom.commands.evaluate import evaluate_run
    from atom.config import Config
    from atom.model import build_model, materialize
    from atom.store.checkpoint import load_checkpoint

    text = tmp_path / "held_out.txt"
    text.write_text("the units stream through the device and the loss falls\n" * 30)
    r = evaluate_run(run_dir, text, batch=3)  # 3 does not divide the windows: a short batch
    ckpt = load_checkpoint(run_dir)
    cfg = Config.from_dict(ckpt.meta["config"])
    model = materialize(build_model(cfg.model), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ckpt.get(name))
        ids = torch.tensor(list(text.read_bytes()))
        T, n = cfg.model.seq_len, (len(ids) - 1) // cfg.model.seq_len
        x, y = ids[: n * T].view(n, T), ids[1 : n * T + 1].view(n, T)
        _, want = model(x, y)
    assert r.windows == n and r.tokens == n * T
    assert math.isclose(r.loss, float(want), rel_tol=1e-5)
    assert math.isclose(r.perplexity, math.exp(r.loss), rel_tol=1e-9)
    code, out, _ = run_cli(capsys, "eval", str(run_dir), "--data", str(text))
    assert code == 0 and "perplexity" in out and f"{r.loss:.4f}" in out
    code, _, err = run_cli(capsys, "eval", str(run_dir), "--data", str(tmp_path / "none"))
    assert code == 2 and "does not exist" in err


def test_a_run_left_in_the_checkout_does_not_change_a_test(own_working_directory):
    """The README's first command leaves runs/default in the repository root; a test
    that ran `atom train` from there was refused ("runs/default already holds a run")."""
    assert Path.cwd() == own_working_directory
    assert not any(own_working_directory.iterdir())
    assert Path.cwd().resolve() != Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv,code",
    [(["profile", "--hardware", "rtx3090", "--host-mem", "8GiB"], 141), (["--help"], 0)],
)
def test_a_closed_pipe_ends_the_command_quietly(argv, code):
    """`atom profile | head -1`: the reader leaves; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "atom.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first line
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err  # 141: 128 + SIGPIPE, as a shell says it
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_every_generate_option_is_explained(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, words in (("--tokens", "tokens to generate"), ("--temperature", "likeliest"),
                          ("--top-k", "k likeliest"), ("--seed", "same text")):  # fmt: skip
        assert option in text and words in text, option


def test_eval_of_a_text_file_is_quiet_and_scores_a_short_one(run_dir, tmp_path, capsys, caplog):
    """It logged an INFO line about its temporary dataset; a text shorter than the context
    was refused (now: one shorter window)."""
    import logging

    from atom.commands.evaluate import evaluate_run

    short = tmp_path / "short.txt"
    short.write_text("the loss falls")  # 14 bytes: under seq_len 32
    with caplog.at_level(logging.INFO):
        r = evaluate_run(run_dir, short)
    assert r.windows == 1 and r.tokens == 13
    assert "prepared" not in caplog.text and "/tmp" not in caplog.text.replace(str(short), "")
