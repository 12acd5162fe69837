"""Swapped vs resident step time, measured side by side in one run.

On CPU (the CPU backend; what CI machines have):

    python -m tools.bench_swap --steps 20
    python -m tools.bench_swap --config gpt2-124m --set model.seq_len=256 --steps 6

Steps alternate between the two engines (swapped, resident, swapped, ...) so machine
noise hits both alike; the ratio of the medians is reported. A swapped step is timed
until its host optimizer work has finished too (no hidden tail).

On a GPU (when one is available):

    python -m tools.bench_swap --config gpt3-2.7b --gpu-mem 24GiB --steps 6 --deepspeed

caps the process's device memory (torch.cuda.set_per_process_memory_fraction) to emulate a
consumer card, measures pinned H2D bandwidth at the unit size, trains swapped, tries
resident (reports OOM when it does not fit), reports achieved H2D bandwidth as a fraction
of the measured pinned-copy bandwidth and the bus-transfer floor, and, with --deepspeed,
tokens/s of DeepSpeed ZeRO-3 with parameters and optimizer offloaded to CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time

import psutil
import torch

from atom.config import Config, load_config, replace
from atom.sizes import parse_bytes
from atom.train import build_engine, resolve_device

log = logging.getLogger("bench_swap")


def make_batches(cfg: Config, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch, cfg.model.seq_len + 1)
    out = []
    for _ in range(cfg.train.grad_accum):
        x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def timed_step(engine, batches, sync) -> float:
    t0 = time.perf_counter()
    engine.train_step(batches, 1e-4)
    engine.wait_idle()
    sync()
    return time.perf_counter() - t0


def pinned_bandwidth(numel: int, dtype: torch.dtype, device, reps: int = 10) -> float:
    host = torch.empty(numel, dtype=dtype, pin_memory=True)
    dev = torch.empty(numel, dtype=dtype, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return reps * host.nbytes / (time.perf_counter() - t0)


def bench_side_by_side(cfg: Config, steps: int, warmup: int) -> dict:
    device, _ = resolve_device(cfg)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    swapped = build_engine(cfg, resident=False)
    try:
        resident = build_engine(cfg, resident=True)
    except torch.OutOfMemoryError:
        resident = None
        torch.cuda.empty_cache()
    times = {"swapped": [], "resident": []}
    for i in range(warmup + steps):
        batches = make_batches(cfg, i)
        for name, engine in (("swapped", swapped), ("resident", resident)):
            if engine is None:
                continue
            try:
                dt = timed_step(engine, batches, sync)
            except torch.OutOfMemoryError:
                log.warning("resident training does not fit: out of device memory")
                resident = None
                del engine
                torch.cuda.empty_cache()
                continue
            if i >= warmup:
                times[name].append(dt)
    result = {"swapped_step_s": statistics.median(times["swapped"])}
    if times["resident"]:
        result["resident_step_s"] = statistics.median(times["resident"])
        result["ratio"] = result["swapped_step_s"] / result["resident_step_s"]
    else:
        result["resident_step_s"] = None  # did not fit
    tokens = cfg.train.micro_batch * cfg.train.grad_accum * cfg.model.seq_len
    result["swapped_tokens_per_s"] = tokens / result["swapped_step_s"]
    result["device_peak_bytes"] = swapped.device_peak_bytes()
    if device.type == "cuda":
        unit_numel = max(u.n_total for u in swapped.units)
        bw = pinned_bandwidth(unit_numel, swapped.dtype, device)
        bytes_per_step = swapped.slots.loads * swapped.slots.slot_bytes / (warmup + steps)
        result["pinned_h2d_GBps"] = bw / 1e9
        result["bus_floor_s"] = bytes_per_step / bw
        result["achieved_h2d_fraction"] = (bytes_per_step / result["swapped_step_s"]) / bw
    swapped.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gpu-mem", default=None, help="cap device memory, e.g. 24GiB")
    ap.add_argument(
        "--deepspeed",
        action="store_true",
        help="GPU: also measure DeepSpeed ZeRO-3 with CPU offload",
    )
    ap.add_argument(
        "--grid",
        action="store_true",
        help="CPU: also sweep layers_per_unit x prefetch x checkpoint",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_flush_denormal(True)
    base = (
        [
            "model.n_layer=6",
            "model.d_model=384",
            "model.n_head=6",
            "model.seq_len=256",
            "train.micro_batch=8",
            "swap.checkpoint=false",
        ]
        if args.config is None
        else []
    )
    cfg = load_config(args.config, base + args.overrides)
    device, dtype = resolve_device(cfg)
    if args.gpu_mem and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(parse_bytes(args.gpu_mem) / total, device)
    hardware = (
        f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    print(f"# bench_swap on {hardware}; torch {torch.__version__}; {dtype}")
    variants = [{}]
    if args.grid:
        variants = [
            {"layers_per_unit": lpu, "prefetch": pf, "checkpoint": ck}
            for ck in (False, True)
            for lpu in (1, 2)
            for pf in (1, 2)
        ]
    print("| layers/unit | prefetch | checkpoint | swapped s | resident s | ratio |")
    print("|---:|---:|:---:|---:|---:|---:|")
    results = []
    for variant in variants:
        run_cfg = replace(cfg, swap=variant) if variant else cfg
        r = bench_side_by_side(run_cfg, args.steps, args.warmup)
        r["swap"] = run_cfg.to_dict()["swap"]
        results.append(r)
        sw = run_cfg.swap
        ratio = f"{r['ratio']:.3f}x" if "ratio" in r else "resident OOM"
        res = f"{r['resident_step_s']:.4f}" if r["resident_step_s"] else "-"
        print(
            f"| {sw.layers_per_unit} | {sw.prefetch} | {sw.checkpoint} | "
            f"{r['swapped_step_s']:.4f} | {res} | {ratio} |",
            flush=True,
        )
    if args.deepspeed and device.type == "cuda":
        from tools.deepspeed_baseline import deepspeed_tokens_per_s

        ds = deepspeed_tokens_per_s(cfg, lambda i: make_batches(cfg, i), args.steps, args.warmup)
        print(
            f"DeepSpeed ZeRO-3 offload: {ds:,.0f} tokens/s; atom swapped: "
            f"{results[0]['swapped_tokens_per_s']:,.0f} tokens/s "
            f"({results[0]['swapped_tokens_per_s'] / ds:.2f}x)"
        )
        results[0]["deepspeed_tokens_per_s"] = ds
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
