"""Quality check against a published result: nanoGPT's CPU run on tiny Shakespeare.

nanoGPT's README reports val loss 1.88 for: 4 layers, 4 heads, 128 dims, context 64,
batch 12, 2000 iterations, lr 1e-3 cosine-decayed to 1e-4 over 2000 after 100 warm-up,
no dropout, character level, first 90% train / last 10% val. atom trains the same model
with swapping on (layers_per_unit 1, prefetch 1) and byte-level tokens (the corpus is
ASCII, so bytes are characters).

    python -m tools.bench.shakespeare ../shared/data/tinyshakespeare.txt --out runs/shakespeare
    python -m tools.bench.shakespeare ../shared/data/tinyshakespeare.txt \
        --out runs/shakespeare-compact \
        --set swap.state=compact
    python -m tools.bench.shakespeare ../shared/data/tinyshakespeare.txt \
        --out runs/shakespeare-bf16 \
        --set swap.state=bf16

Prints the validation curve as a markdown table and the final val loss (target <= 1.93).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from atom.config import Config, apply_overrides
from atom.data.tokens import prepare
from atom.run.train import Trainer


def nanogpt_cpu_config(data_dir: Path, eval_batches: int, overrides: list[str]) -> Config:
    data = {
        "model": {
            "arch": "gpt",
            "n_layer": 4,
            "n_head": 4,
            "d_model": 128,
            "seq_len": 64,
            "vocab_size": 256,
            "bias": False,
        },
        "train": {
            "micro_batch": 12,
            "grad_accum": 1,
            "lr": 1e-3,
            "min_lr": 1e-4,
            "warmup_steps": 100,
            "lr_decay_steps": 2000,
            "max_steps": 2000,
            "beta1": 0.9,
            "beta2": 0.99,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "eval_interval": 250,
            "eval_batches": eval_batches,
            "ckpt_interval": 0,
            "device": "cpu",
            "dtype": "fp32",
            "data": str(data_dir),
        },
        "swap": {"layers_per_unit": 1, "prefetch": 1, "checkpoint": True},
    }
    return Config.from_dict(apply_overrides(data, overrides))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text", help="path to tinyshakespeare.txt")
    ap.add_argument("--out", default="runs/shakespeare", help="run directory")
    ap.add_argument(
        "--eval-batches",
        type=int,
        default=200,
        help="validation batches of 12 per evaluation (nanoGPT's CPU run used 20)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a setting of the nanoGPT configuration (e.g. swap.state=compact)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    data_dir = out / "data"
    prepare([Path(args.text)], data_dir, val_fraction=0.1, progress=False)
    cfg = nanogpt_cpu_config(data_dir, args.eval_batches, args.set)
    t0 = time.perf_counter()
    summary = Trainer(cfg, out, progress=sys.stderr.isatty()).run()
    wall = time.perf_counter() - t0
    print("| step | train loss | val loss |\n|---:|---:|---:|")
    for rec in summary.history:
        if "val_loss" in rec:
            print(f"| {rec['step']} | {rec['loss']:.4f} | {rec['val_loss']:.4f} |")
    result = {
        "final_val_loss": summary.val_loss,
        "target": 1.93,
        "nanogpt_reported": 1.88,
        "wall_s": round(wall, 1),
        "tokens_per_s": summary.tokens_per_s,
    }
    print(json.dumps(result))
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if summary.val_loss is not None and summary.val_loss <= 1.93 else 1


if __name__ == "__main__":
    sys.exit(main())
