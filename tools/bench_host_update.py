"""The host update per parameter: compact state (bf16 + Kahan, 8-bit moments) vs fp32
(norm, torch's fused AdamW, the bf16 refresh), as the profiler measures them.

    python -m tools.bench_host_update --threads 1
    python -m tools.bench_host_update --threads 2
"""

from __future__ import annotations

import argparse

import torch

from atom.profiler.hardware import measure_compact_update, measure_host_optimizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="measure the host update, compact vs fp32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    compact = measure_compact_update() * 1e9
    fp32 = measure_host_optimizer(8_000_000, torch.bfloat16)[0] * 1e9
    print(
        f"{torch.get_num_threads()} thread(s): compact update {compact:.2f} ns/param; fp32 "
        f"update (norm, fused AdamW, bf16 refresh) {fp32:.2f} ns/param; {compact / fp32:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
