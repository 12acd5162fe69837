"""Child processes for tools/gpu_check: each bounded by what is left of the check's time
budget, killed whole (its process group) when it runs past it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DEADLINE_ENV = "GPU_CHECK_DEADLINE"  # epoch seconds: the budget's end, seen by children
PROFILE_ENV = "GPU_CHECK_PROFILE"  # JSON list: `atom profile` flags for the `big` section


def seconds_left() -> float:
    return float(os.environ.get(DEADLINE_ENV, time.time() + 3600)) - time.time()


class SkipSection(Exception):
    pass


def run_child(args: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run a child python; its output (last part) and exit code. A hang is killed."""
    # the project first, then what the caller's PYTHONPATH had (the GPU machine's wheels
    # installed with --target: without them a child cannot import what the parent could)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}
    timeout = max(1.0, min(timeout, seconds_left() - 1))  # never past the budget
    # its own process group: a timeout kills the grandchildren too (a compiler DeepSpeed
    # started would otherwise hold the pipes open past the budget)
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out[-6000:]
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return 124, f"timed out after {timeout:.0f} s\n" + (out or "")[-6000:]
