"""What fits on the cards hobbyists own, and how fast: `atom profile` on every preset card x
host RAM, as one markdown table (the README's); and, with --models, every model on one card
beside what torchtune can run on one card.

    python -m tools.hardware_table                      # llama-3.1-8b, its batch and 64
    python -m tools.hardware_table --config llama-1b --batch 8 --hosts 16 32
    python -m tools.hardware_table --models llama-3.1-8b llama-2-13b codellama-34b \\
        llama-3.1-70b --cards rtx4090 --hosts 64 128 --batch 64

Each cell is the profiler's choice for that card (profiler/hardware.py PRESETS, each rate
with its source) and that much host RAM: its predicted tokens/s, what bounds it, and the
host state and where it lives; or, when nothing fits, the RAM the model needs. A plan that
needs a part the engine lacks (Plan.needs: the profiler's ENGINE_* constants in
profiler/state_formats.py) says "not built yet"; where a plan the engine runs was chosen
and a tiered one would be faster, the model table gives that figure too.
"""

from __future__ import annotations

import argparse
import logging
import re

from atom.config import ConfigError, load_config, replace
from atom.profiler.hardware import PRESETS, GiB
from atom.profiler.planner import Infeasible, describe_host
from atom.profiler.profile import run_profile

CARDS = ["rtx3060", "rtx4060ti", "rtx4070", "rtx3090", "rtx4090", "rtx5090"]
MODELS = ["llama-3.1-8b", "llama-2-13b", "codellama-34b", "llama-3.1-70b"]
# What torchtune runs as a full fine-tune on one card, from its recipe registry
# (torchtune/_recipe_registry.py): full_finetune_single_device has configs up to 8B for
# text Llamas (llama3_1/8B_full_single_device); 13B (llama2/13B_full) and 70B
# (llama3_1/70B_full) only under full_finetune_distributed; no 34B config. Its
# single-device recipe keeps the bf16 weights on the card (and pages 8-bit AdamW
# moments), so 13B's 26 GB of weights alone exceed a 24 GB card whatever the recipe.
TORCHTUNE = {
    "llama-3.1-8b": "runs (llama3_1/8B_full_single_device; 1,650 tokens/s at 2 x 2048 on a "
    "4090, its README)",
    "llama-2-13b": "no single-card recipe (llama2/13B_full: several GPUs; the bf16 weights "
    "alone are 26 GB)",
    "codellama-34b": "no recipe (the bf16 weights alone are 67 GB)",
    "llama-3.1-70b": "no single-card recipe (llama3_1/70B_full: several GPUs; the bf16 "
    "weights alone are 141 GB)",
}


def cell(cfg, card: str, host_gib: int, batch: int, only_tiered: bool = False) -> dict:
    try:
        plan, _, _ = run_profile(cfg, target_batch=batch, host_mem=host_gib * GiB, stated=card,
                                 progress=False, only_tiered=only_tiered,
                                 rivals=False)  # fmt: skip
    except Infeasible as err:
        need = re.search(r"host RAM: the model state needs ([\d.]+ GiB)", str(err))
        return {"fits": False, "why": f"needs {need[1]} of RAM" if need else str(err)[:80]}
    p = plan.prediction
    return {
        "fits": True,
        "tokens_per_s": p.tokens_per_s,
        "bound": p.bottleneck,
        "state": describe_host(plan.swap["state"], plan.disk_tier).split(" (")[0],
        "tiered": plan.tiered,
        "needs": plan.needs,  # what of the plan the engine lacks (nothing, today)
        "host_gib": p.host_bytes / GiB,
        "device_gib": p.peak_device_bytes / GiB,
        "writes_gb": plan.disk["write_bytes_per_step"] / 1e9,
        "endurance_per_day": plan.disk["endurance_per_day"],
        "plan": f"{plan.swap['layers_per_unit']} layers/unit, {plan.micro_batch} x "
        f"{plan.grad_accum}",
    }


def say(c: dict, disk: bool = False) -> str:
    """A cell: tokens/s, what bounds it, the host state; `disk`: and what the plan writes to
    the disk a step, with the share of a 600 TBW drive's endurance a day of it uses."""
    if not c["fits"]:
        return f"does not fit: {c['why']}"
    state = c["state"].replace(" state", "")
    if c["tiered"]:
        state += ", tiered"
    if c.get("needs"):  # a part the engine lacks (the profiler's ENGINE_* constants)
        state += ": not built yet"
    if disk and c["writes_gb"]:
        state += f"; writes {c['writes_gb']:,.0f} GB a step, {c['endurance_per_day']:.1%} of "
        state += "600 TBW a day"
    return f"{c['tokens_per_s']:,.0f} ({c['bound']}-bound; {state})"


def table(cfg, batch: int, hosts: list[int], cards: list[str]) -> str:
    head = "| card | " + " | ".join(f"{h} GiB RAM" for h in hosts) + " |"
    rows = [head, "|---|" + "---:|" * len(hosts)]
    for card in cards:
        cells = [say(cell(cfg, card, h, batch)) for h in hosts]
        rows.append(f"| {PRESETS[card]['name']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def model_table(models: list[str], card: str, batch: int, hosts: list[int]) -> str:
    """A row per model on `card`: the chosen plan at each RAM size (with the disk it writes
    a step and the drive's endurance a day), and torchtune on one card."""
    head = "| model | " + " | ".join(f"{h} GiB RAM" for h in hosts) + " | torchtune, one card |"
    rows = [head, "|---|" + "---:|" * len(hosts) + "---|"]
    for name in models:
        cfg = load_config(name)
        cells = []
        for h in hosts:
            c = cell(cfg, card, h, batch)
            text = say(c, disk=True)
            if c["fits"] and not c["tiered"]:  # what the tiered plan would give instead
                t = cell(cfg, card, h, batch, only_tiered=True)
                if t["fits"] and t["tokens_per_s"] > 1.03 * c["tokens_per_s"]:
                    tiered = say(t, disk=True).replace(", tiered: ", "; ", 1)
                    text += "; tiered: " + tiered.replace(", tiered", "", 1)
            cells.append(text)
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {TORCHTUNE.get(name, '-')} |")
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
    ap.add_argument(
        "--models", nargs="+", metavar="CONFIG",
        help=f"a row per model on the first of --cards, beside torchtune (e.g. {' '.join(MODELS)})",
    )  # fmt: skip
    ap.add_argument(
        "--state", choices=["fp32", "compact", "bf16"], default=None,
        help="the host state (swap.state) every plan keeps (default: the profiler's choice "
        "among the exact ones; bf16 only when asked)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        cfg = load_config(args.config)
        if args.state:
            cfg = replace(cfg, swap={"state": args.state})
        if args.models:
            for batch in args.batch or [64]:
                print(f"\n{PRESETS[args.cards[0]]['name']}, batch {batch} x {cfg.model.seq_len}"
                      " tokens:\n")  # fmt: skip
                print(model_table(args.models, args.cards[0], batch, args.hosts))
            return 0
    except ConfigError as err:
        print(f"hardware_table: error: {err}")
        return 2
    own = cfg.train.micro_batch * cfg.train.grad_accum
    batches = args.batch or sorted({own, 64})
    for batch in batches:
        print(
            f"\n`{args.config}`, batch {batch} x {cfg.model.seq_len} tokens "
            f"(`atom profile --config {args.config} --hardware CARD --host-mem N"
            f"GiB --batch {batch}{f' --set swap.state={args.state}' if args.state else ''}`):\n"
        )
        print(table(cfg, batch, args.hosts, args.cards))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
