"""What runs from a checkout (`python -m tools.NAME`), by purpose:

- `bench/`: benchmarks, each side by side in its own processes (docs/benchmarks.md)
- `gpu_check` and `gpu/`: the GPU self-check, one command on a CUDA machine
- `net/`: kernel-shaped networks between namespaces, a lossy user-space wire, the fault soak
- `baselines/`: what users run today (torchtune, DeepSpeed, DDP, GPipe) on atom's model
- here: `doc_transcripts` (the docs' transcripts, checked or rewritten), `config_reference`
  (docs/config.md), `hardware_table` (the README's table), `jsonl` (reading run logs)
"""

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
