"""The 70B plan's twin, measured: what `atom profile` predicts the NVMe tiers read and write
a step, against what the engine counts when it trains that plan (issue 43).

    python -m tools.bench.twin [--steps 10] [--weights-in-ram 0.3] [--disk DIR]

The twin is a llama of the 70B's shape at 1.22M parameters (6 layers, 128 wide, grouped
heads, untied), on this CPU stated as a card with a consumer NVMe drive, its "card" and RAM
capped so the plan takes the 70B's shape: unit-major over 4 micro-batches, every update on
the card, units kept there, the weights of units 0.. and every unit's optimizer state on
the disk. It trains the plan on the CPU backend with the tiers in DIR (default: a temporary
directory) and prints, per step, the bytes read and written against the plan's, the RAM
held against the plan's host figure, and the step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from atom.config import Config
from atom.profiler import tiers
from atom.profiler.cost import Candidate, peak_device_bytes
from atom.profiler.hardware import GiB
from atom.profiler.planner import analysis
from atom.profiler.profile import run_profile
from atom.swap.pinned import page_aligned

TWIN = {"arch": "llama", "n_layer": 6, "d_model": 128, "d_ff": 344, "n_head": 4, "n_kv_head": 2,
        "vocab_size": 512, "seq_len": 64, "tie_embeddings": False}  # fmt: skip
# this CPU stated as a card and a consumer NVMe drive (the rates pick the plan, not the
# bytes it moves)
CPU = {"name": "CPU (stated)", "device": "cpu", "device_mem": GiB, "host_mem": GiB,
       "h2d_bps": 5e9, "d2h_bps": 1e300, "duplex_h2d_bps": 5e9, "matmul_flops": 5e10,
       "adam_s_per_param": 2e-9, "accum_s_per_param": 5e-10, "host_shares_compute": True,
       "disk_read_bps": 3e9, "disk_write_bps": 1.5e9}  # fmt: skip


def twin_config(**swap) -> Config:
    return Config.from_dict({
        "model": TWIN, "train": {"micro_batch": 2, "grad_accum": 4, "dtype": "fp32",
                                 "device": "cpu"},
        "swap": {"state": "fp32", **swap},
    })  # fmt: skip


def caps(weights_in_ram: float) -> tuple[int, int]:
    """(gpu_mem, host_mem): the card holds two units kept across steps and every unit
    input; RAM the state tier's slots, the weight tier's and `weights_in_ram` of the weights
    of the units streamed."""
    a = analysis(twin_config(), 1)
    w = [u.n_total * 4 for u in a.units]
    card = Candidate(1, 0, 4, 2, True, False, resident_units=2, card_update="all",
                     update="eager", tiered=True)  # fmt: skip
    gpu = peak_device_bytes(a, card, torch.float32, cuda=False)
    slots = tiers.STATE_SLOTS * max(a.record_bytes("fp32")) + 3 * page_aligned(max(w))
    # the two units kept on the card keep no host copy of their weights (host_store.py)
    streamed = sum(w) - sum(w[-3:-1])
    return gpu, slots + int(streamed * weights_in_ram)


def measure(plan, disk: Path, steps: int) -> list[dict]:
    from atom.optim import lr_at
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine

    cfg = plan.apply(twin_config(disk_dir=str(disk)))
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    g = torch.Generator().manual_seed(0)
    rows, last = [], (0, 0)
    try:
        for step in range(steps):
            batches = []
            for _ in range(cfg.train.grad_accum):
                x = torch.randint(0, TWIN["vocab_size"], (2, TWIN["seq_len"] + 1), generator=g)
                batches.append((x[:, :-1], x[:, 1:]))
            t0 = time.perf_counter()
            engine.train_step(batches, lr_at(step, cfg.train))
            engine.wait_idle()
            for t in _tiers(engine):
                if hasattr(t, "flush"):
                    t.flush()
            seconds = time.perf_counter() - t0
            now = (sum(t.bytes_read for t in _tiers(engine)),
                   sum(t.bytes_written for t in _tiers(engine)))  # fmt: skip
            rows.append({"step": step, "read": now[0] - last[0], "written": now[1] - last[1],
                         "seconds": seconds})  # fmt: skip
            last = now
        ram = engine.store.nbytes() + sum(t.slot_bytes for t in _tiers(engine))
    finally:
        engine.close()
    for row in rows:
        row["ram"] = ram
    return rows


def _tiers(engine) -> list:
    found = [engine.tier] + ([engine.wdisk.tier] if getattr(engine, "wdisk", None) else [])
    return found + ([engine.acts] if engine.acts is not None else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--weights-in-ram",
        type=float,
        default=0.3,
        help="the share of the streamed units' weights RAM has room for (the rest: the disk)",
    )
    ap.add_argument("--disk", type=Path, default=None, help="the tiers' directory")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cpu.json"
        spec.write_text(json.dumps(CPU))
        gpu, host = caps(args.weights_in_ram)
        plan, _, _ = run_profile(twin_config(), gpu_mem=gpu, host_mem=host, stated=str(spec),
                                 progress=False, only_tiered=True)  # fmt: skip
        s = plan.prediction.detail["tiers"]
        print(
            f"plan: weights of units {s['weight_units']} on the disk, state of "
            f"{s['state_units']}, inputs of {s['input_units']}; card update "
            f"{plan.swap['card_update']}, {plan.swap['resident_units']} unit(s) kept on the "
            f"card, {plan.grad_accum} micro-batches; needs: {plan.needs or 'nothing more'}"
        )
        disk = args.disk or Path(tmp)
        rows = measure(plan, disk, args.steps)
    want_r, want_w = plan.disk["read_bytes_per_step"], plan.disk["write_bytes_per_step"]
    print("| step | read (plan) | written (plan) | read/plan | written/plan | step s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows[1:]:  # the first step's reads find records written fresh at init
        print(
            f"| {r['step']} | {r['read']:,} ({want_r:,}) | {r['written']:,} ({want_w:,}) | "
            f"{r['read'] / want_r:.3f} | {r['written'] / want_w:.3f} | {r['seconds']:.3f} |"
        )
    held = rows[-1]["ram"] + s["ram_acts"]
    print(
        f"RAM held {held:,} bytes, plan {plan.prediction.host_bytes:,} "
        f"({held / plan.prediction.host_bytes:.3f}); median step "
        f"{statistics.median(r['seconds'] for r in rows[1:]):.3f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
