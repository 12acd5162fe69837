"""tools/gpu_check's CPU dry run: every section runs on tiny shapes, so the script that
proves a GPU machine cannot rot between the few runs that have one.

    pytest tests/test_gpu_check.py
"""

from __future__ import annotations

import json

import pytest

from tools import gpu_check
from tools.gpu import proc as gpu_proc


@pytest.mark.slow
def test_gpu_check_dry_run_writes_a_complete_report(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE", str(tmp_path / "cache"))
    assert gpu_check.main([str(tmp_path / "report"), "--dry-run"]) == 0
    report = json.loads((tmp_path / "report" / "gpu_check.json").read_text())
    sections = report["sections"]
    assert set(sections) == {"env", "bandwidth", "tests", "attention", "equivalence", "fits",
                             "tiers", "big", "deepspeed", "torchtune", "compile"}  # fmt: skip
    assert report["failed"] == []
    tune = sections["torchtune"]  # the baseline ran, on the CPU, beside big's atom run
    assert tune["tokens_per_s"] > 0 and tune["atom_over_torchtune"] > 0
    assert sections["equivalence"]["worst_fp32_rel_err"] <= 1e-5
    assert sections["compile"]["compiled"] and sections["compile"]["loss_rel_drift"] <= 1e-4
    big = sections["big"]
    assert big["train_exit"] == 0 and big["peak_over_predicted"] > 0
    assert {(v["order"], v["update"]) for v in big["variants"]} == {
        ("unit", "exact"),
        ("unit", "eager"),
        ("micro", "exact"),
    }
    tiers = sections["tiers"]["rows"]
    assert [r.get("bit_identical") for r in tiers if r["state"] == "fp32" and r["disk"]] == [True]
    assert (tmp_path / "report" / "gpu_check.md").read_text().startswith("# gpu_check")


def test_a_section_the_budget_cannot_fit_is_skipped_with_a_line(tmp_path):
    """--budget bounds the whole check: what would start with less than its minimum is
    skipped, saying why and what to do, and the check still exits 0 with a report."""
    out = tmp_path / "report"
    assert gpu_check.main([str(out), "--dry-run", "--budget", "30",
                           "--only", "env", "equivalence", "big"]) == 0  # fmt: skip
    sections = json.loads((out / "gpu_check.json").read_text())["sections"]
    assert sections["env"]["status"] == "ok"
    for name in ("equivalence", "big"):
        assert sections[name]["status"] == "skipped"
        assert "out of the time budget" in sections[name]["why"]
        assert "--budget" in sections[name]["why"]


def test_a_child_past_its_time_is_killed_with_its_children():
    """A section's child that hangs (and its own children holding the output pipe, as a
    compiler DeepSpeed starts would) is killed at its timeout, whole."""
    import time

    script = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(60)']); time.sleep(60)")  # fmt: skip
    t0 = time.monotonic()
    code, out = gpu_proc.run_child(["-c", script], timeout=2)
    assert code == 124 and "timed out after 2 s" in out
    assert time.monotonic() - t0 < 15


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """`atom profile`'s plan for the dry run's `big` model; (report dir, child env)."""
    tmp = tmp_path_factory.mktemp("big")
    out = tmp / "report"
    out.mkdir()
    env = {"GPU_CHECK_OUT": str(out), "ATOM_CACHE": str(tmp / "cache")}
    argv = ["-m", "atom.cli", "profile", "--config", "tiny", "--gpu-mem", "1GiB",
            "--batch", "8", "--out", str(out / "plan.json")]  # fmt: skip
    code, log = gpu_proc.run_child(argv, timeout=300, env=env)
    assert code == 0, log
    return out, env


def _train_child(out, env, patch: str) -> tuple[int, dict]:
    """gpu_check's `big` training child with `patch` run first; (exit, big_train.json)."""
    (out / "big_train.json").unlink(missing_ok=True)
    plan = str(out / "plan.json")
    script = (f"import os, signal, tools.gpu.proc, tools.gpu.steps as s; {patch}; "
              f"s.train_child({plan!r}, 'tiny', '1GiB', 1, True, [])")  # fmt: skip
    code, log = gpu_proc.run_child(["-c", script], timeout=300, env=env)
    assert (out / "big_train.json").exists(), log
    return code, json.loads((out / "big_train.json").read_text())


@pytest.mark.slow
def test_big_keeps_its_numbers_when_the_budget_kills_it(tiny_plan):
    """SIGKILLed (the budget's end) in the schedule variants: the main step's figures were
    written when they existed (they used to be written in a `finally` that never ran)."""
    kill = "s._schedule_variants = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)"
    code, res = _train_child(*tiny_plan, kill)
    assert code == -9
    assert res["tokens_per_s"] > 0 and res["step_s"] > 0 and "variants" not in res


@pytest.mark.slow
def test_big_skips_the_variants_the_budget_cannot_fit(tiny_plan):
    code, res = _train_child(*tiny_plan, "tools.gpu.proc.seconds_left = lambda: 0.0")
    assert code == 0 and res["tokens_per_s"] > 0
    assert len(res["variants"]) == 3
    assert all("out of the time budget" in v["skipped"] for v in res["variants"])
