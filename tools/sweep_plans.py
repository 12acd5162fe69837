"""Measure a grid of plans for a small model and see where the profiler's choice ranks.

    python -m tools.sweep_plans                      # GPT 4 layers, d 256, context 128, batch 8
    python -m tools.sweep_plans --set model.arch=llama --batch 16

For every plan in the grid (layers per unit x prefetch x micro-batch x checkpointing) the
swapped step time is measured next to the profiler's prediction: the fastest of --steps
steps after a warm-up (host work included), over --rounds passes through the grid, so
that load from other processes, which only ever adds time, hits every plan alike. Then
the plan the profiler chose is located in the measured ranking. Target: the chosen plan
within 5% of the best measured one.
On a GPU add --gpu-mem to compare predicted with torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch

from atom.config import load_config, replace
from atom.train import build_engine
from profiler.hardware import parse_bytes
from profiler.profile import run_profile
from tools.bench_swap import make_batches


def measure_plan(cfg, steps: int) -> tuple[float, int]:
    engine = build_engine(cfg)
    cuda = engine.backend.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for i in range(steps + 1):
            batches = make_batches(cfg, i)
            t0 = time.perf_counter()
            engine.train_step(batches, 1e-4)
            engine.wait_idle()
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        return min(times), engine.device_peak_bytes()
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gpu-mem", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_flush_denormal(True)
    base = (
        []
        if args.config
        else ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=128"]
    )
    cfg = load_config(args.config, base + args.overrides)
    gpu_mem = parse_bytes(args.gpu_mem) if args.gpu_mem else None
    plan, ranked, hw = run_profile(cfg, args.batch, gpu_mem=gpu_mem, progress=False)
    by_key = {}
    for s in ranked:
        c = s.candidate
        if c.offload_activations or c.prefetch > 2 or c.layers_per_unit not in (1, 2, 4):
            continue  # keep the grid small; offload is a no-op on the CPU backend
        by_key[c] = s.prediction
    best_time: dict = {}
    peaks: dict = {}
    for _ in range(args.rounds):
        for c in by_key:
            run_cfg = replace(
                cfg,
                swap={
                    "layers_per_unit": c.layers_per_unit,
                    "prefetch": c.prefetch,
                    "checkpoint": c.checkpoint,
                    "offload_activations": False,
                },
                train={"micro_batch": c.micro_batch, "grad_accum": c.grad_accum},
            )
            step, peaks[c] = measure_plan(run_cfg, args.steps)
            best_time[c] = min(step, best_time.get(c, float("inf")))
    rows = []
    for c, pred in by_key.items():
        rows.append((c, pred, best_time[c], peaks[c]))
        print(
            f"lpu {c.layers_per_unit} prefetch {c.prefetch} mb {c.micro_batch}x{c.grad_accum} "
            f"ckpt {c.checkpoint}: predicted {pred.step_s:.4f}s measured {best_time[c]:.4f}s, "
            f"peak predicted {pred.peak_device_bytes / 2**20:.1f} MiB measured "
            f"{peaks[c] / 2**20:.1f} MiB",
            file=sys.stderr,
            flush=True,
        )
    rows.sort(key=lambda r: r[2])
    best = rows[0][2]
    chosen = next(
        r
        for r in rows
        if r[0] == ranked[0].candidate
        or (r[0].layers_per_unit, r[0].prefetch, r[0].micro_batch, r[0].checkpoint)
        == (
            plan.swap["layers_per_unit"],
            plan.swap["prefetch"],
            plan.micro_batch,
            plan.swap["checkpoint"],
        )
    )
    rank = rows.index(chosen) + 1
    errors = [abs(p.step_s - m) / m for _, p, m, _ in rows]
    mem_errors = [abs(p.peak_device_bytes - k) / k for _, p, _, k in rows]
    print(f"# sweep_plans on {hw.name}; {len(rows)} plans; batch {args.batch}")
    print(
        "| rank | layers/unit | prefetch | micro-batch x accum | checkpoint | predicted s | "
        "measured s | vs best |"
    )
    print("|---:|---:|---:|---:|:---:|---:|---:|---:|")
    for i, (c, p, m, _) in enumerate(rows[:10], 1):
        mark = " (chosen)" if (c, p, m, _) == chosen else ""
        print(
            f"| {i}{mark} | {c.layers_per_unit} | {c.prefetch} | {c.micro_batch} x "
            f"{c.grad_accum} | {c.checkpoint} | {p.step_s:.4f} | {m:.4f} | {m / best:.3f}x |"
        )
    summary = {
        "chosen_rank": rank,
        "chosen_vs_best": chosen[2] / best,
        "plans": len(rows),
        "median_step_error": statistics.median(errors),
        "max_peak_bytes_error": max(mem_errors),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
