"""The host update per parameter: compact state (bf16 + remainder, 8-bit moments), compiled
(swap.compile_update, the default) and eager, against fp32 state (the norm, torch's fused
AdamW, the bf16 refresh), as the profiler measures them; and the bf16 state's update
(swap.state=bf16: eager, stochastic rounding), whose ratio to compact's the profiler uses.

    python -m tools.bench.host_update --threads 2 --rounds 5
    python -m tools.bench.host_update --threads 1

Each measurement runs in a fresh process, as a user's run would (two in one process share
OpenMP teams and caches); a round runs the three kinds, their order rotating round by
round. A ratio is the median of the per-round ratios, with their spread; each kind's
fastest round is printed beside its median (on a machine shared with other work the
fastest is the nearer to the quiet figure, and the load average the fairer caveat). The
compiled kind's first process compiles (~30 s on 2 cores) and leaves Inductor's cache for
the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics

from tools.bench.rounds import interleaved, ratio

KINDS = ("compiled", "eager", "fp32", "bf16")


def measure_one(kind: str, numel: int) -> float:
    """ns per parameter of one update of a unit of `numel` parameters, in this process."""
    import torch

    from atom.profiler.hardware import (
        measure_bf16_update,
        measure_compact_update,
        measure_host_optimizer,
    )

    torch.set_flush_denormal(True)  # as atom train does
    if kind == "fp32":
        return measure_host_optimizer(numel, torch.bfloat16)[0] * 1e9
    if kind == "bf16":
        return measure_bf16_update(numel) * 1e9
    return measure_compact_update(numel, compiled=kind == "compiled") * 1e9


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
        print(json.dumps({"value": measure_one(args.one, args.numel)}))
        return 0
    got = interleaved("tools.bench.host_update", KINDS, args.rounds, args.numel, args.threads)
    fig = {k: f"{statistics.median(v):.2f} ({min(v):.2f})" for k, v in got.items()}
    pairs = [("compiled", "fp32"), ("eager", "fp32"), ("eager", "compiled"), ("bf16", "compiled")]
    print(
        f"threads {args.threads or 'default'}, {args.numel:,} parameters, {args.rounds} rounds, "
        f"ns/param, median (fastest): compact compiled {fig['compiled']}, compact eager "
        f"{fig['eager']}, fp32 {fig['fp32']}, bf16 state {fig['bf16']}; "
        + ", ".join(f"{a}/{b} {ratio(got, a, b)}" for a, b in pairs)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
