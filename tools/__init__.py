"""Benchmarks and checks that run from a checkout (`python -m tools.NAME`)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tool_env(extra: dict | None = None) -> dict:
    """The environment for a child that runs `python -m tools.NAME`: the checkout first on
    PYTHONPATH, so the child imports `tools` from any working directory (a tool started from
    elsewhere, or a test running in its own directory), then what the caller had."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}
