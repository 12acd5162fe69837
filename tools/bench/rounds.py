"""Side-by-side measurement for the micro-benchmarks: each kind in a fresh process (two in
one process share OpenMP teams and caches, which flatters one of them), a round running
every kind once with the order rotating round by round, and a ratio as the median of the
per-round ratios with their spread.

A benchmark module using it answers `python -m MODULE --one KIND --numel N [--threads T]`
with one JSON line `{"value": ...}` (tools/bench/host_update.py, tools/bench/landing.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys


def child(module: str, kind: str, numel: int, threads: int) -> float:
    """KIND's figure from a fresh `python -m MODULE --one KIND` process."""
    env = dict(os.environ)
    cmd = [sys.executable, "-m", module, "--one", kind, "--numel", str(numel)]
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["value"]


def interleaved(
    module: str, kinds: tuple[str, ...], rounds: int, numel: int, threads: int
) -> dict[str, list[float]]:
    """Every kind once per round, the order rotating; a line per round as it ends."""
    got: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        shift = r % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            got[kind].append(child(module, kind, numel, threads))
        print(f"round {r + 1}: " + ", ".join(f"{k} {got[k][-1]:.2f}" for k in kinds))
    return got


def ratio(got: dict[str, list[float]], a: str, b: str) -> str:
    """a/b as the median of the per-round ratios, with their range."""
    rs = [x / y for x, y in zip(got[a], got[b], strict=True)]
    return f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"
