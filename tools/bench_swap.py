"""Swapped vs resident step time, measured side by side in one run, with the traffic.

On CPU (the CPU backend; what CI machines have), the issue's small shape (6 layers,
d_model 256, context 128, one layer per unit, prefetch 1) at micro-batch 4 x 1 and
2 x 8, with and without recompute:

    python -m tools.bench_swap --rounds 7
    python -m tools.bench_swap --config gpt2-124m --set model.seq_len=256 --rounds 3

Runs alternate between the engines in blocks of --steps consecutive optimizer steps
(swapped, resident, swapped, ...), so machine noise hits both alike; a block is timed as
training runs (steps back to back, the host optimizer overlapping the next step), until
its last host work has finished. The ratio of the medians over rounds is reported, with
the spread (min-max of per-round ratios). A swapped run with recompute
(swap.checkpoint: true) is compared with a resident run that also recomputes (activation
checkpointing per block), so the ratio is the cost of swapping, not of recomputing.

Per configuration it also reports:
- H2D bytes per step (counted per copy) and the minimum: every unit once for the forward
  and once for the backward, less the units kept on the device between the two;
- D2H gradient copies and bytes per step, and the minimum (each unit once);
- exposed host time per step: compute waiting for a copy that waited for the host
  optimizer, plus waiting at the end of the step for gradients and norms to land.

On a GPU:

    python -m tools.bench_swap --config gpt3-2.7b --set model.vocab_size=256 \
        --set train.micro_batch=1 --accum 8 --gpu-mem 24GiB --rounds 2

caps device memory (torch.cuda.set_per_process_memory_fraction) to emulate a consumer
card and reports the resident run as OOM when it does not fit, the pinned H2D bandwidth
and the bus floor (bytes counted / bandwidth).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import sys
import time

import psutil
import torch

from atom.config import Config, load_config, replace
from atom.device import resolve_device
from atom.sizes import parse_bytes
from atom.train import build_engine

log = logging.getLogger("bench_swap")

SMALL_SHAPE = [
    "model.n_layer=6",
    "model.d_model=256",
    "model.n_head=4",
    "model.seq_len=128",
    "swap.layers_per_unit=1",
    "swap.prefetch=1",
]


def make_batches(cfg: Config, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch, cfg.model.seq_len + 1)
    out = []
    for _ in range(cfg.train.grad_accum):
        x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


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


def min_traffic(engine) -> tuple[int, int]:
    """(H2D, D2H) bytes per step no schedule can beat: each unit's weights once per pass
    (the last `prefetch` body units stay between forward and backward), each gradient once."""
    dt = torch.empty(0, dtype=engine.dtype).element_size()
    sizes = [u.n_total * dt for u in engine.units]
    body = sizes[:-1]
    kept = min(engine.cfg.swap.prefetch, len(body))
    h2d = sum(sizes) + sum(body[: len(body) - kept])
    return h2d, sum(sizes)


class Block:
    """Times `steps` consecutive optimizer steps of one engine."""

    def __init__(self, engine, cfg: Config, sync):
        self.engine, self.cfg, self.sync = engine, cfg, sync
        self.seed = 0

    def run(self, steps: int) -> float:
        batches = [make_batches(self.cfg, self.seed + i) for i in range(steps)]
        self.seed += steps
        t0 = time.perf_counter()
        for b in batches:
            self.engine.train_step(b, 1e-4)
        self.engine.wait_idle()
        self.sync()
        return (time.perf_counter() - t0) / steps


def _counters(engine) -> dict:
    return {
        "h2d": engine.slots.bytes_loaded,
        "d2h": engine.d2h_bytes,
        "d2h_copies": engine.d2h_copies,
        "opt_wait": engine.slots.optimizer_wait_s,
        "load_wait": engine.slots.load_wait_s,
        "norm_wait": engine.norm_wait_s,
    }


def bench_config(cfg: Config, rounds: int, steps: int, resident_too: bool = True) -> dict:
    device, dtype = resolve_device(cfg)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    swapped = build_engine(cfg, resident=False)
    blocks = {"swapped": Block(swapped, cfg, sync)}
    blocks["swapped"].run(2)  # warm-up (allocation, first touch, optimizer state), alone:
    swapped_peak = swapped.device_peak_bytes()  # its peak before a resident model joins
    resident = None
    if resident_too:
        from atom.resident import ResidentEngine

        fits = True
        try:
            resident = ResidentEngine(cfg, device, dtype, recompute=cfg.swap.checkpoint)
            blocks["resident"] = Block(resident, cfg, sync)
            blocks["resident"].run(1)
        except torch.cuda.OutOfMemoryError:
            fits = False  # freed below: the exception's traceback holds the model here
        if not fits:
            log.warning("resident training does not fit: out of device memory")
            blocks.pop("resident", None)
            resident = None
            gc.collect()
            torch.cuda.empty_cache()
    times: dict[str, list[float]] = {k: [] for k in blocks}
    before = _counters(swapped)
    swapped_steps = 0
    for _ in range(rounds):
        for name in list(blocks):
            fits = True
            try:
                times[name].append(blocks[name].run(steps))
                if name == "swapped":
                    swapped_steps += steps
            except torch.cuda.OutOfMemoryError:
                fits = False
            if not fits:  # outside the except block, so the failed step can be freed
                log.warning("resident training does not fit: out of device memory")
                del blocks[name], times[name]
                resident = None
                gc.collect()
                torch.cuda.empty_cache()
    after = _counters(swapped)
    per = {k: (after[k] - before[k]) / swapped_steps for k in after}
    h2d_min, d2h_min = min_traffic(swapped)
    result = {
        "swap": cfg.to_dict()["swap"],
        "micro_batch": cfg.train.micro_batch,
        "grad_accum": cfg.train.grad_accum,
        "swapped_step_s": statistics.median(times["swapped"]),
        "h2d_bytes_per_step": per["h2d"],
        "h2d_min_bytes": h2d_min,
        "d2h_copies_per_step": per["d2h_copies"],
        "d2h_bytes_per_step": per["d2h"],
        "d2h_min_bytes": d2h_min,
        "load_wait_s_per_step": per["load_wait"],
        "exposed_host_s_per_step": per["opt_wait"] + per["norm_wait"],
        "device_peak_bytes": swapped_peak,
    }
    if "resident" in times:
        ratios = [s / r for s, r in zip(times["swapped"], times["resident"], strict=True)]
        result["resident_step_s"] = statistics.median(times["resident"])
        result["ratio"] = result["swapped_step_s"] / result["resident_step_s"]
        result["ratio_spread"] = [min(ratios), max(ratios)]
    else:
        result["resident_step_s"] = None
    tokens = cfg.train.micro_batch * cfg.train.grad_accum * cfg.model.seq_len
    result["swapped_tokens_per_s"] = tokens / result["swapped_step_s"]
    if cuda:
        unit_numel = max(u.n_total for u in swapped.units)
        bw = pinned_bandwidth(unit_numel, swapped.dtype, device)
        result["pinned_h2d_GBps"] = bw / 1e9
        result["bus_floor_s"] = per["h2d"] / bw
        result["achieved_h2d_fraction"] = per["h2d"] / result["swapped_step_s"] / bw
    swapped.close()
    del swapped, resident, blocks
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=None, help="default: the small shape above")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=5, help="alternating blocks per engine")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per block")
    ap.add_argument(
        "--shapes",
        default="4x1,2x8",
        help="micro-batch x grad_accum pairs (default 4x1,2x8)",
    )
    ap.add_argument("--recompute", default="no,yes", help="swap.checkpoint values to run")
    ap.add_argument("--order", default="unit", help="swap.order values to run (unit,micro)")
    ap.add_argument("--no-resident", action="store_true", help="swapped only (model too big)")
    ap.add_argument("--gpu-mem", default=None, help="cap device memory, e.g. 24GiB")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_flush_denormal(True)
    base = SMALL_SHAPE if args.config is None else []
    cfg = load_config(args.config, base + args.overrides)
    device, dtype = resolve_device(cfg)
    if args.gpu_mem and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, parse_bytes(args.gpu_mem) / total)  # a cap above the card: none
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    hardware = (
        f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    print(
        f"# bench_swap {time.strftime('%Y-%m-%d')} on {hardware}; torch {torch.__version__}; "
        f"{dtype}; {args.rounds} rounds x {args.steps} steps"
    )
    print(
        "| micro x accum | recompute | order | swapped s | resident s | ratio (spread) | "
        "H2D MiB/step (min) | D2H copies, MiB/step (min) | exposed host s/step |"
    )
    print("|---|---|---|---:|---:|---|---|---|---:|")
    results = []
    for shape in args.shapes.split(","):
        micro, accum = (int(v) for v in shape.lower().split("x"))
        for ck in args.recompute.split(","):
            for order in args.order.split(","):
                run_cfg = replace(
                    cfg,
                    train={"micro_batch": micro, "grad_accum": accum},
                    swap={"checkpoint": ck == "yes", "order": order},
                )
                r = bench_config(run_cfg, args.rounds, args.steps, not args.no_resident)
                results.append(r)
                if r["resident_step_s"]:
                    lo, hi = r["ratio_spread"]
                    ratio = f"{r['ratio']:.3f}x ({lo:.2f}-{hi:.2f})"
                    res = f"{r['resident_step_s']:.4f}"
                else:
                    ratio, res = "-", "OOM" if not args.no_resident else "-"
                print(
                    f"| {micro} x {accum} | {ck} | {order} | {r['swapped_step_s']:.4f} | {res} | "
                    f"{ratio} | {_mib(r['h2d_bytes_per_step'])} ({_mib(r['h2d_min_bytes'])}) | "
                    f"{r['d2h_copies_per_step']:.0f}, {_mib(r['d2h_bytes_per_step'])} "
                    f"({_mib(r['d2h_min_bytes'])}) | {r['exposed_host_s_per_step']:.4f} |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
