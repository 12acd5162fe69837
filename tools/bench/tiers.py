"""Where the host state lives: RAM vs the NVMe tier, fp32 vs compact, side by side.

Each configuration trains in its own process (so its peak RSS is its own), in rounds that
alternate the configurations (so machine noise hits all alike):

    python -m tools.bench.tiers --disk-dir /var/tmp --rounds 3 --steps 4

Default shape: a GPT of 12 layers, d_model 1024 (~160M parameters: 1.9 GB of fp32 cold
state on disk, 0.97 GB compact), context 128, micro-batch 2, one layer per unit, on the
CPU backend. The tier opens its files with O_DIRECT where the filesystem allows (the
report says which), so reads come from the disk, not the page cache, whatever the state's
size against RAM.

Per configuration: median step time over rounds (each round's figure: its steps after one
warm-up step, run back to back as training runs them, so a step's updates and their disk
traffic overlap the next step's forward, timed until the last update has finished, divided
by the steps), the spread, the ratio to fp32-in-RAM, peak RSS, and disk bytes read and
written per step.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tools import tool_env

SHAPE = [
    "model.n_layer=12",
    "model.d_model=1024",
    "model.n_head=16",
    "model.seq_len=128",
    "model.vocab_size=256",
    "train.micro_batch=2",
    "train.device=cpu",
    "train.dtype=fp32",
    "swap.layers_per_unit=1",
    "swap.prefetch=1",
]
CONFIGS = {
    "fp32, RAM": [],
    "fp32, disk": ["disk"],
    "compact, RAM": ["swap.state=compact"],
    "compact, disk": ["swap.state=compact", "disk"],
}


def child(args) -> int:
    from atom.config import load_config
    from atom.optim import lr_at
    from atom.profiler.analysis import ModelAnalysis
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine

    torch.set_flush_denormal(True)
    cfg = load_config(None, args.set)
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    g = torch.Generator().manual_seed(0)

    def step(i: int) -> None:
        x = torch.randint(0, 256, (cfg.train.micro_batch, cfg.model.seq_len + 1), generator=g)
        engine.train_step([(x[:, :-1].contiguous(), x[:, 1:].contiguous())], lr_at(i, cfg.train))

    try:
        step(0)  # warm-up
        engine.wait_idle()
        tier = engine.tier
        read0, written0 = (tier.bytes_read, tier.bytes_written) if tier else (0, 0)
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            step(i)
        engine.wait_idle()  # the last step's updates (and their disk traffic) included
        elapsed = time.perf_counter() - t0
        result = {
            "step_s": elapsed / args.steps,
            "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "disk_read_per_step": (tier.bytes_read - read0) / args.steps if tier else 0,
            "disk_written_per_step": (tier.bytes_written - written0) / args.steps if tier else 0,
            "o_direct": bool(tier and tier.direct),
            "predicted_host_bytes": ModelAnalysis.of(cfg).host_bytes(
                torch.float32, cfg.swap.state, tier is not None, cfg.swap.disk_slots
            ),
            "n_params": sum(b.spec.n_owned for b in engine.store.buffers),
        }
    finally:
        engine.close()
    Path(args.out).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("--set", action="append", default=[])
    c.add_argument("--steps", type=int, default=4)
    c.add_argument("--out", required=True)
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(), help="the NVMe tier's directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (after a warm-up)")
    ap.add_argument("--set", action="append", default=[], help="override the shape")
    args = ap.parse_args(argv)
    if args.cmd == "child":
        return child(args)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, extra in CONFIGS.items():
                sets = SHAPE + args.set + [e for e in extra if e != "disk"]
                if "disk" in extra:
                    sets.append(f"swap.disk_dir={args.disk_dir}")
                out = Path(tmp) / f"{r}-{len(runs[name])}.json"
                cmd = [sys.executable, "-m", "tools.bench.tiers", "child", "--steps",
                       str(args.steps), "--out", str(out)]  # fmt: skip
                for item in sets:
                    cmd += ["--set", item]
                subprocess.run(cmd, check=True, env=tool_env())
                runs[name].append(json.loads(out.read_text()))
                print(f"round {r + 1}: {name}: {runs[name][-1]['step_s']:.3f} s", file=sys.stderr)
    base = statistics.median(x["step_s"] for x in runs["fp32, RAM"])
    first = runs["fp32, RAM"][0]
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {first['n_params'] / 1e6:.0f}M parameters; "
        f"disk dir {args.disk_dir} (O_DIRECT: {runs['fp32, disk'][0]['o_direct']})\n"
    )
    print(
        "| host state | step s (median) | spread | vs fp32 in RAM | peak RSS | model state "
        "in RAM (profiler) | disk read / written per step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rs in runs.items():
        steps = [x["step_s"] for x in rs]
        med = statistics.median(steps)
        rss = max(x["rss_peak_bytes"] for x in rs)
        io = rs[0]
        disk = (
            f"{io['disk_read_per_step'] / 1e9:.2f} / {io['disk_written_per_step'] / 1e9:.2f} GB"
            if io["disk_read_per_step"]
            else "-"
        )
        print(
            f"| {name} | {med:.3f} | {min(steps):.3f}-{max(steps):.3f} | {med / base:.2f}x | "
            f"{rss / 2**30:.2f} GiB | {io['predicted_host_bytes'] / 2**30:.2f} GiB | {disk} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
