"""The host update per parameter: compact state (bf16 + Kahan, 8-bit moments), compiled
(swap.compile_update, the default) and eager, against fp32 state (the norm, torch's fused
AdamW, the bf16 refresh), as the profiler measures them.

    python -m tools.bench_host_update --threads 2 --rounds 5
    python -m tools.bench_host_update --threads 1

Each measurement runs in a fresh process, as a user's run would (two in one process share
OpenMP teams and caches); a round runs the three kinds, their order rotating round by
round. A ratio is the median of the per-round ratios, with their spread. The compiled
kind's first process compiles (~30 s on 2 cores) and leaves Inductor's cache for the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

KINDS = ("compiled", "eager", "fp32")


def measure_one(kind: str, numel: int) -> float:
    """ns per parameter of one update of a unit of `numel` parameters, in this process."""
    import torch

    from atom.profiler.hardware import measure_compact_update, measure_host_optimizer

    torch.set_flush_denormal(True)  # as atom train does
    if kind == "fp32":
        return measure_host_optimizer(numel, torch.bfloat16)[0] * 1e9
    return measure_compact_update(numel, compiled=kind == "compiled") * 1e9


def _in_process(kind: str, numel: int, threads: int) -> float:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "tools.bench_host_update", "--one", kind, "--numel", str(numel)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["ns_per_param"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="measure the host update, compact vs fp32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--numel", type=int, default=8_000_000, help="parameters in the unit")
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args(argv)
    if args.one:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps({"ns_per_param": measure_one(args.one, args.numel)}))
        return 0
    got: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        order = KINDS[r % 3 :] + KINDS[: r % 3]
        for kind in order:
            got[kind].append(_in_process(kind, args.numel, args.threads))
        print(f"round {r + 1}: " + ", ".join(f"{k} {got[k][-1]:.2f}" for k in KINDS))

    def ratio(a: str, b: str) -> str:
        rs = [x / y for x, y in zip(got[a], got[b], strict=True)]
        return f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"

    med = {k: statistics.median(v) for k, v in got.items()}
    print(
        f"threads {args.threads or 'default'}, {args.numel:,} parameters, {args.rounds} rounds, "
        f"ns/param (median): compact compiled {med['compiled']:.2f}, compact eager "
        f"{med['eager']:.2f}, fp32 {med['fp32']:.2f}; compiled/fp32 {ratio('compiled', 'fp32')}, "
        f"eager/fp32 {ratio('eager', 'fp32')}, eager/compiled {ratio('eager', 'compiled')}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
