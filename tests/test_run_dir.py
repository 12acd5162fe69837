"""A run directory holds one run, whichever of its folders --resume names, and resuming
says what it does: a finished run, a dataset given as a run, an older checkpoint, a
shorter schedule, a peer restarted as the README says."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atom.store.run_dir import continue_from, run_of
from tests.test_cli import run_cli

STEPS = 4


def _sets(text_dataset) -> list[str]:
    return ["--set", "model.n_layer=2", "--set", "model.seq_len=32", "--set",
            f"train.data={text_dataset}", "--set", "train.ckpt_interval=2",
            "--set", "train.warmup_steps=1", "--no-progress"]  # fmt: skip


@pytest.fixture
def finished(tmp_path, text_dataset, capsys) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *_sets(text_dataset), "--max-steps", str(STEPS),
                           "--out", str(out))  # fmt: skip
    assert code == 0, err
    return out


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


def test_resuming_a_runs_checkpoints_folder_continues_the_run_itself(finished, capsys):
    """`--resume RUN/checkpoints` used to nest a new run inside it (checkpoints/checkpoints)."""
    assert run_of(finished / "checkpoints") == finished
    assert run_of(finished / "checkpoints" / "step_00000002") == finished
    code, _, err = run_cli(capsys, "train", "--resume", str(finished / "checkpoints"),
                           "--max-steps", "6", "--no-progress")  # fmt: skip
    assert code == 0, err
    assert not (finished / "checkpoints" / "checkpoints").exists()
    assert not (finished / "checkpoints" / "metrics.jsonl").exists()
    assert _steps(finished) == list(range(1, 7)) and _checkpoints(finished)[-1] == "step_00000006"


def test_resuming_a_dataset_says_it_is_not_a_run(text_dataset, capsys):
    code, _, err = run_cli(capsys, "train", "--resume", str(text_dataset), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not a checkpoint" in err and "format_version" not in err and "--out" in err


def test_resuming_a_finished_run_is_refused_with_the_fix(finished, capsys):
    """It printed "checkpoint None" and exited 0, having trained nothing."""
    code, out, err = run_cli(capsys, "train", "--resume", str(finished), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"at step {STEPS}" in err and f"--max-steps N (N > {STEPS})" in err
    assert "None" not in out + err


def test_resuming_an_older_checkpoint_sets_the_newer_aside_and_says_so(finished, capsys, caplog):
    """Resumed from step 2 of a run that reached 4: the step-4 checkpoint is moved out of the
    way (kept), so the run's newest checkpoint is what this run saves, and a later --resume
    continues this run, not the abandoned one."""
    older = finished / "checkpoints" / "step_00000002"
    with caplog.at_level(logging.WARNING, logger="atom.store.run_dir"):
        code, out, err = run_cli(capsys, "train", "--resume", str(older), "--max-steps", "3",
                                 "--no-progress")  # fmt: skip
    assert code == 0, err
    assert "step_00000004" in caplog.text and "set aside" in caplog.text
    assert (finished / "checkpoints" / "superseded" / "step_00000004" / "meta.json").exists()
    assert _checkpoints(finished) == ["step_00000002", "step_00000003"]
    assert _steps(finished) == [1, 2, 3]
    # the shorter schedule is said, and the LR follows the planned curve
    assert "train.max_steps: 4 -> 3; the LR keeps its planned decay over 4 steps" in out
    code, _, err = run_cli(capsys, "train", "--resume", str(finished), "--max-steps", "5",
                           "--no-progress")  # fmt: skip
    assert code == 0, err
    assert _steps(finished) == [1, 2, 3, 4, 5]


def test_continue_from_keeps_every_set_aside_checkpoint(tmp_path):
    run = tmp_path / "r"
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    assert continue_from(run, 1) == [run / "checkpoints" / "superseded" / "step_00000002"]
    (run / "checkpoints" / "step_00000002").mkdir()  # trained again, then resumed from 1 again
    moved = continue_from(run, 1)
    assert moved == [run / "checkpoints" / "superseded" / "step_00000002.1"]
    assert sorted(p.name for p in (run / "checkpoints" / "superseded").iterdir()) == [
        "step_00000002", "step_00000002.1"
    ]  # fmt: skip


def test_a_resumed_planned_run_does_not_say_it_has_no_plan(finished, capsys):
    code, out, err = run_cli(capsys, "train", "--resume", str(finished), "--max-steps", "5",
                             "--no-progress")  # fmt: skip
    assert code == 0, err
    assert "no --plan" not in out


def test_a_restarted_peer_is_told_the_command_that_works(finished, capsys):
    """README: "a restarted one rejoins". Re-running its first command is refused (the run
    directory holds its run): the line gives --resume with the peer's own flags."""
    argv = ["train", "--out", str(finished), "--listen", "tcp://127.0.0.1:0", "--join",
            "tcp://127.0.0.1:5555", "--no-progress"]  # fmt: skip
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        f"atom train --resume {finished} --listen tcp://127.0.0.1:0 --join tcp://127.0.0.1:5555"
        in err
    )


def test_missing_data_is_said_before_a_taken_run_directory(finished, capsys):
    code, _, err = run_cli(capsys, "train", "--out", str(finished), "--set",
                           "train.data=/no/such/data", "--no-progress")  # fmt: skip
    assert code == 2 and "/no/such/data" in err and "already holds" not in err


def test_a_run_directory_is_claimed_by_one_process_at_a_time(tmp_path):
    """The claim names its holder, and a directory it created and nothing else wrote (a
    refused or failed command) is gone with it."""
    from atom.ground.errors import ConfigError
    from atom.store.run_dir import claim

    run = tmp_path / "runs" / "busy"
    with claim(run):
        with pytest.raises(ConfigError) as refused:
            claim(run)  # another open file description: refused like another process
        assert f"PID {os.getpid()}" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "runs").exists()
    with claim(tmp_path / "kept") as held:
        (held.path / "metrics.jsonl").write_text("")
    assert (tmp_path / "kept" / "metrics.jsonl").exists()
    with claim(tmp_path / "kept"):  # released: the next command takes it
        pass


def _wait_for(predicate, what: str, proc, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"{what}: the first training exited {proc.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.multiprocess
def test_two_trainings_on_one_run_directory(tmp_path, text_dataset, capsys):
    """issue 42: `atom train --out runs/busy` twice at once both ran, interleaving
    metrics.jsonl, and the refusal's own advice (--resume) then ran a second writer beside
    the first. The second is refused with the first's PID (exit 2), a new run and a resume
    alike; once the first is SIGKILLed its claim is taken over and the run resumes."""
    out = tmp_path / "busy"
    cmd = [sys.executable, "-m", "atom.cli", "train", "--out", str(out), "--max-steps",
           "100000", "--set", "train.ckpt_interval=5", *_sets(text_dataset)]  # fmt: skip
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: bool(_checkpoints(out) if (out / "checkpoints").exists() else []),
                  "a checkpoint", first)  # fmt: skip
        for argv in (["--out", str(out)], ["--resume", str(out)]):
            code, _, err = run_cli(capsys, "train", *argv, *_sets(text_dataset))
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert f"in use by another atom process (PID {first.pid}: atom train" in err
        first.kill()  # SIGKILL: no chance to release anything itself
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)
    steps = _steps(out)
    assert steps == sorted(steps)  # one writer: no interleaved records
    resumed = int(_checkpoints(out)[-1].split("_")[1])
    code, _, err = run_cli(capsys, "train", "--resume", str(out), "--max-steps",
                           str(resumed + 2), *_sets(text_dataset))  # fmt: skip
    assert code == 0, err
    assert _steps(out)[-1] == resumed + 2


def test_an_export_into_a_run_being_trained_is_refused(finished, capsys):
    from atom.store.run_dir import claim

    with claim(finished):  # as a training there holds it
        code, _, err = run_cli(capsys, "export", str(finished), "--hf", str(finished / "hf"))
        assert code == 2 and f"PID {os.getpid()}" in err and "export outside it" in err
    code, _, err = run_cli(capsys, "export", str(finished), "--hf", str(finished / "hf"))
    assert code == 0, err


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_corrupt_newest_checkpoint_is_refused_and_left_untouched(finished, capsys, damage):
    """issue 42: `--resume RUN` with a damaged newest checkpoint warned, trained from the
    one before and moved the damaged one into superseded/, though the docs said such a
    checkpoint is refused with one line naming an older one and left untouched. Damage
    on disk is the user's to know of: refused, in one line naming the older one."""
    victim = finished / "checkpoints" / "step_00000004" / "unit_001.safetensors"
    if damage == "truncated":  # the size no longer matches: found before anything else
        os.truncate(victim, 1000)
    else:  # the same size, another sha256: found when the resume hashes its files
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(finished)): p.read_bytes() for p in finished.rglob("*")
                if p.is_file() and p.name != "run.lock"}  # fmt: skip

    before = files()
    code, _, err = run_cli(capsys, "train", "--resume", str(finished), "--max-steps", "6",
                           "--no-progress")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "step_00000004 is corrupt" in err
    assert f"--resume {finished / 'checkpoints' / 'step_00000002'}" in err
    assert files() == before
    code, _, err = run_cli(capsys, "train", "--resume",
                           str(finished / "checkpoints" / "step_00000002"), "--max-steps", "3",
                           "--no-progress")  # fmt: skip
    assert code == 0, err  # the named fix works (the damaged one is then set aside, kept)
