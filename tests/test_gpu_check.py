"""tools/gpu_check's CPU dry run: every section runs on tiny shapes, so the script that
proves a GPU machine cannot rot between the few runs that have one.

    pytest tests/test_gpu_check.py
"""

from __future__ import annotations

import json

import pytest

from tools import gpu_check, gpu_proc


@pytest.mark.slow
def test_gpu_check_dry_run_writes_a_complete_report(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE", str(tmp_path / "cache"))
    assert gpu_check.main([str(tmp_path / "report"), "--dry-run"]) == 0
    report = json.loads((tmp_path / "report" / "gpu_check.json").read_text())
    sections = report["sections"]
    assert set(sections) == {"env", "bandwidth", "tests", "equivalence", "fits", "tiers", "big",
                             "deepspeed"}  # fmt: skip
    assert report["failed"] == []
    assert sections["equivalence"]["worst_fp32_rel_err"] <= 1e-5
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
