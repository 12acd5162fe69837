"""What fits on the cards hobbyists own, and how fast: `atom profile` on every preset card x
host RAM, as one markdown table (the README's).

    python -m tools.hardware_table                      # llama-3.1-8b, its batch and 64
    python -m tools.hardware_table --config llama-1b --batch 8 --hosts 16 32

Each cell is the profiler's choice for that card (profiler/hardware.py PRESETS, each rate
with its source) and that much host RAM: its predicted tokens/s, what bounds it, and the
host state and where it lives; or, when nothing fits, the RAM the model needs.
"""

from __future__ import annotations

import argparse
import logging
import re

from atom.config import ConfigError, load_config
from atom.profiler.hardware import PRESETS, GiB
from atom.profiler.planner import Infeasible, describe_host
from atom.profiler.profile import run_profile

CARDS = ["rtx3060", "rtx4060ti", "rtx4070", "rtx3090", "rtx4090", "rtx5090"]


def cell(cfg, card: str, host_gib: int, batch: int) -> dict:
    try:
        plan, _, _ = run_profile(
            cfg, target_batch=batch, host_mem=host_gib * GiB, stated=card, progress=False
        )
    except Infeasible as err:
        need = re.search(r"host RAM: the model state needs ([\d.]+ GiB)", str(err))
        return {"fits": False, "why": f"needs {need[1]} of RAM" if need else str(err)[:80]}
    p = plan.prediction
    return {
        "fits": True,
        "tokens_per_s": p.tokens_per_s,
        "bound": p.bottleneck,
        "state": describe_host(plan.swap["state"], plan.disk_tier).split(" (")[0],
        "host_gib": p.host_bytes / GiB,
        "device_gib": p.peak_device_bytes / GiB,
        "plan": f"{plan.swap['layers_per_unit']} layers/unit, {plan.micro_batch} x "
        f"{plan.grad_accum}",
    }


def table(cfg, batch: int, hosts: list[int], cards: list[str]) -> str:
    head = "| card | " + " | ".join(f"{h} GiB RAM" for h in hosts) + " |"
    rows = [head, "|---|" + "---:|" * len(hosts)]
    for card in cards:
        cells = []
        for h in hosts:
            c = cell(cfg, card, h, batch)
            if not c["fits"]:
                cells.append(f"does not fit: {c['why']}")
            else:
                state = c["state"].replace(" state", "")
                cells.append(f"{c['tokens_per_s']:,.0f} ({c['bound']}-bound; {state})")
        rows.append(f"| {PRESETS[card]['name']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-3.1-8b")
    ap.add_argument(
        "--batch", type=int, nargs="+", default=None, help="sequences per step (default: the "
        "config's, and 64)",
    )  # fmt: skip
    ap.add_argument("--hosts", type=int, nargs="+", default=[32, 64, 128], help="GiB of RAM")
    ap.add_argument("--cards", nargs="+", default=CARDS, choices=sorted(PRESETS))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        print(f"hardware_table: error: {err}")
        return 2
    own = cfg.train.micro_batch * cfg.train.grad_accum
    batches = args.batch or sorted({own, 64})
    for batch in batches:
        print(
            f"\n`{args.config}`, batch {batch} x {cfg.model.seq_len} tokens "
            f"(`atom profile --config {args.config} --hardware CARD --host-mem N"
            f"GiB --batch {batch}`):\n"
        )
        print(table(cfg, batch, args.hosts, args.cards))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
