"""The gradient landing's GB/s against a plain memcpy of the same bytes, on the same cores.

    python -m tools.bench.landing --threads 1 --rounds 5

A landing is the host worker's share of a gradient's way home (atom/swap/landing.py): the
pieces of a D2H transfer copied (the first run of a step) or added (later runs) into the
unit's host gradient. Kinds, each timed in a fresh process, the order rotating by round:

- memcpy: `dst.copy_(src)` of the same bytes, same dtype (the floor a landing is held to);
- compact: bf16 pieces copied into the bf16 host gradient (compact state's landing);
- fp32: bf16 pieces copied into the fp32 host gradient (fp32 state, no accumulation);
- add: bf16 pieces added into the fp32 host gradient (micro-batch-major's later runs).

GB/s counts the gradient's bytes as they arrive (bf16): what the D2H stream delivers and the
landing must keep up with. The pieces are the CUDA staging pool's chunks (one unit in 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tools.bench.rounds import interleaved, ratio

KINDS = ("memcpy", "compact", "fp32", "add")


def measure_one(kind: str, numel: int, reps: int = 7) -> float:
    """GB/s of one kind over a gradient of `numel` bf16 elements, in this process."""
    import torch

    from atom.swap.backend import Transfer
    from atom.swap.landing import GradientLanding

    src = torch.randn(numel).bfloat16()
    if kind == "memcpy":
        dst = torch.empty_like(src)

        def run() -> None:
            dst.copy_(src)
    else:
        grad = torch.zeros(numel, dtype=torch.bfloat16 if kind == "compact" else torch.float32)
        chunk = -(-numel // 8)
        pieces = [(k, src[k : k + chunk]) for k in range(0, numel, chunk)]

        class Pieces:  # the CUDA backend's contract (host_pieces, release_host) on host memory
            def host_pieces(self, t):
                yield from pieces

            def release_host(self, t) -> None:
                pass

        landing = GradientLanding(Pieces(), [grad], [[]])
        first = kind != "add"

        def run() -> None:
            landing.land(0, Transfer(), first)

    run()  # first touch of the pages
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the gradient landing against a memcpy")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--numel", type=int, default=64 << 20, help="gradient elements (bf16)")
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args(argv)
    if args.one:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps({"value": measure_one(args.one, args.numel)}))
        return 0
    got = interleaved("tools.bench.landing", KINDS, args.rounds, args.numel, args.threads)
    print(
        f"threads {args.threads or 'default'}, {args.numel:,} bf16 elements, {args.rounds} "
        f"rounds; GB/s (median) memcpy {statistics.median(got['memcpy']):.2f}; of memcpy: "
        + ", ".join(f"{k} {ratio(got, k, 'memcpy')}" for k in KINDS[1:])
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
