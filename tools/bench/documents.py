"""What packing documents costs: plain stream windows vs rows packed with documents kept
apart (each attends only to itself: a (B, 1, T, T) mask instead of SDPA's causal path),
side by side on one swapped engine.

    python -m tools.bench.documents --rounds 5 --steps 3

Per sequence length: the same model and batch shape trains on three kinds of batch,
alternated round by round so machine noise hits all alike:
- plain: (x, y), SDPA with is_causal (what text pretraining runs);
- one document per row: positions 0..T-1, so the mask path with nothing to cut;
- packed: documents of ~`--doc-len` tokens, a third of the targets ignored (prompts).
Reported: median step time over rounds, the spread (min-max), and the ratio to plain.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from atom.config import Config
from atom.model.documents import IGNORE, positions_in_documents
from atom.optim import lr_at
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine


def config(seq_len: int, args) -> Config:
    return Config.from_dict(
        {
            "model": {"arch": "llama", "n_layer": args.layers, "d_model": args.d_model,
                      "n_head": args.d_model // 64, "seq_len": seq_len, "vocab_size": 256},
            "train": {"micro_batch": args.batch, "grad_accum": 1, "device": "cpu",
                      "dtype": "fp32", "warmup_steps": 1},
            "swap": {"layers_per_unit": 1, "prefetch": 1},
        }
    )  # fmt: skip


def batches(kind: str, step: int, B: int, T: int, doc_len: int) -> list[tuple]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (B, T + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if kind == "plain":
        return [(x, y)]
    if kind == "one document per row":
        return [(x, y, torch.arange(T).expand(B, T).contiguous())]
    starts = torch.rand(B, T, generator=g) < 1.0 / doc_len
    starts[:, 0] = True
    positions = positions_in_documents(starts)
    prompt = torch.rand(B, T, generator=g) < 1 / 3
    return [(x, y.masked_fill(prompt, IGNORE), positions)]


KINDS = ("plain", "one document per row", "packed")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", default="256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and kind")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=128, help="mean packed document length")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; llama {args.layers}x{args.d_model}, "
          f"micro-batch {args.batch}, documents ~{args.doc_len} tokens")  # fmt: skip
    print("| seq_len | batch | step ms (median) | spread | vs plain |")
    print("|---|---|---|---|---|")
    for T in (int(t) for t in args.seq_lens.split(",")):
        cfg = config(T, args)
        engine = SwapEngine(cfg, CpuBackend(), torch.float32)
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        try:
            for kind in KINDS:  # warm-up: first-use allocations
                engine.train_step(batches(kind, 0, args.batch, T, args.doc_len), 1e-4)
            for r in range(args.rounds):
                for kind in KINDS:
                    engine.wait_idle()
                    start = time.perf_counter()
                    for s in range(args.steps):
                        step = 1 + r * args.steps + s
                        b = batches(kind, step, args.batch, T, args.doc_len)
                        engine.train_step(b, lr_at(step, cfg.train))
                    engine.wait_idle()
                    times[kind].append((time.perf_counter() - start) / args.steps * 1e3)
        finally:
            engine.close()
        base = statistics.median(times["plain"])
        for kind in KINDS:
            med = statistics.median(times[kind])
            spread = f"{min(times[kind]):.0f}-{max(times[kind]):.0f}"
            print(f"| {T} | {kind} | {med:.0f} | {spread} | {med / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
