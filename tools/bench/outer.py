"""The outer optimizer at equal steps: N peers on loopback, one run per variant.

    .venv/bin/python -m tools.bench.outer run --peers 4 --steps 600 --repeats 3 \\
        --variants isolated avg diloco diloco-int8
    .venv/bin/python -m tools.bench.outer run \\
        --variant 'h20:gossip.strategy=diloco,gossip.diloco_steps=20'
    .venv/bin/python -m tools.bench.outer report

Every variant trains the model and data of tools/bench/vs_pipeline.py (tools/baselines/
settings.py: 4 layers, d 128, context 64, byte vocabulary, AdamW 1e-3) on N `atom train`
processes (one torch thread each, train.seed = peer index) for the same number of
optimizer steps; gossip variants form a group on loopback (every peer pulls peer 0's
initial weights and waits for the others before its first step), `isolated` trains the N
alone. Afterwards every peer's final checkpoint is evaluated on one fixed validation set
(tools/baselines/analysis.Evaluator), and gossip.json gives the bytes each peer sent per
optimizer step. The variants of one repeat run back to back, in an order rotated every
repeat, so a slow spell of this shared machine does not fall on one variant only.

It answers "is the outer optimizer better at equal steps, and what does compression
cost?"; time to a loss on shaped links is tools/bench/vs_pipeline.py's job.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools.baselines.settings import ATOM_ONLY, MODEL, TRAIN
from tools.bench.vs_pipeline import _endpoint, _wait, child_env, prepare, sets
from tools.jsonl import read_records

log = logging.getLogger("bench_outer")

# named variants: gossip settings on top of the group's (None: no gossip at all)
VARIANTS: dict[str, dict | None] = {
    "isolated": None,
    "avg": {"gossip.strategy": "gossip"},
    "avg-int8": {"gossip.strategy": "gossip", "gossip.codec": "int8"},
    "diloco": {"gossip.strategy": "diloco"},
    "diloco-bf16": {"gossip.strategy": "diloco", "gossip.codec": "bf16"},
    "diloco-int8": {"gossip.strategy": "diloco", "gossip.codec": "int8"},
}


def parse_variant(spec: str) -> tuple[str, dict]:
    """'NAME:key=value,key=value' -> (NAME, {key: value})."""
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant looks like NAME:key=value,key=value, got {spec!r}")
    items = [kv.split("=", 1) for kv in body.split(",") if kv.strip()]
    if any(len(kv) != 2 for kv in items):
        raise SystemExit(f"--variant {spec!r}: every item must be key=value")
    return name, {k.strip(): v.strip() for k, v in items}


def run_variant(out: Path, data: Path, peers: int, steps: int, gossip: dict | None) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    runs = [out / f"peer{i}" for i in range(peers)]
    procs: list[subprocess.Popen] = []
    base = {**MODEL, **TRAIN, "swap.checkpoint": "false", "train.eval_interval": 0,
            "train.ckpt_interval": 0, "train.data": data}  # fmt: skip
    try:
        for i, run in enumerate(runs):
            cmd = [sys.executable, "-m", "atom.cli", "train", "--no-progress",
                   "--max-steps", str(steps), "--out", str(run)]  # fmt: skip
            settings = {**base, "train.seed": i}
            if gossip is not None:
                settings.update({k: v for k, v in ATOM_ONLY.items() if k.startswith("gossip.")})
                settings.update({"gossip.wait_peers": peers - 1, "gossip.name": f"peer{i}",
                                 **gossip})  # fmt: skip
                cmd += ["--listen", "tcp://127.0.0.1:0"]
                if i:
                    cmd += ["--join", _endpoint(runs[0])]
            with open(out / f"peer{i}.log", "w") as f:
                procs.append(subprocess.Popen(cmd + sets(settings), stdout=f,
                                              stderr=subprocess.STDOUT,
                                              env=child_env()))  # fmt: skip
            if gossip is not None and not i:
                _wait(lambda: _endpoint(runs[0]), 90, "peer 0 to listen", procs)
        deadline = time.monotonic() + 120 + steps * 2.0
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"peers exited with {codes}: see {out}/peer*.log")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def measure(ev, out: Path, peers: int) -> dict:
    from atom.store.checkpoint import load_checkpoint

    losses, sent, walls, exchanges = [], [], [], []
    for i in range(peers):
        run = out / f"peer{i}"
        newest = max((run / "checkpoints").glob("step_*"))
        ckpt = load_checkpoint(newest)
        weights = {n: ckpt.get(n) for n in ckpt.names() if not n.startswith("optim.")}
        losses.append(ev.loss(f"{newest}@{(newest / 'meta.json').stat().st_mtime_ns}",
                              lambda w=weights: w))  # fmt: skip
        metrics = read_records(run / "metrics.jsonl")
        walls.append(sum(r["step_time_s"] for r in metrics))
        try:
            status = json.loads((run / "gossip.json").read_text())
        except (OSError, json.JSONDecodeError):
            status = {}
        wire = status.get("wire") or {}
        if wire.get("sent_per_step") is not None:
            sent.append(wire["sent_per_step"] / wire["model_fp32_bytes"])
        exchanges.append((metrics[-1].get("gossip") or {}).get("exchanges", 0))
    ev.save()
    return {
        "val_loss": statistics.mean(losses),
        "val_losses": losses,
        "sent_per_step_vs_fp32_model": statistics.mean(sent) if sent else 0.0,
        "train_s": statistics.mean(walls),
        "exchanges": exchanges,
    }


def run(args: argparse.Namespace) -> None:
    from tools.baselines.analysis import Evaluator

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = prepare(work)
    variants = {name: VARIANTS[name] for name in args.variants}
    variants.update(parse_variant(spec) for spec in args.variant)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    ev = Evaluator(work)
    names = list(variants)
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            out = work / f"{name}_{r}"
            t0 = time.monotonic()
            log.info("repeat %d: %s (%d peers, %d steps)", r, name, args.peers, args.steps)
            run_variant(out, data, args.peers, args.steps, variants[name])
            res = measure(ev, out, args.peers)
            res.update(variant=name, settings=variants[name], repeat=r, peers=args.peers,
                       steps=args.steps, wall_s=time.monotonic() - t0,
                       date=time.strftime("%Y-%m-%d"))  # fmt: skip
            results.append(res)
            results_path.write_text(json.dumps(results, indent=1) + "\n")
            log.info("%s #%d: val loss %.4f %s, sent/step %.4f x fp32 model, %.0f s", name, r,
                     res["val_loss"], [round(x, 4) for x in res["val_losses"]],
                     res["sent_per_step_vs_fp32_model"], res["train_s"])  # fmt: skip


def report(args: argparse.Namespace) -> None:
    results = json.loads((Path(args.work) / "results.json").read_text())
    by: dict[tuple, list[dict]] = {}
    for res in results:
        by.setdefault((res["variant"], res["peers"], res["steps"]), []).append(res)
    print("| variant | peers | steps | repeats | val loss (each repeat) | mean | "
          "bytes sent per step / fp32 model | training s |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for (name, peers, steps), rs in by.items():
        vals = " / ".join(f"{r['val_loss']:.3f}" for r in rs)
        print(f"| {name} | {peers} | {steps} | {len(rs)} | {vals} | "
              f"{statistics.mean(r['val_loss'] for r in rs):.3f} | "
              f"{statistics.mean(r['sent_per_step_vs_fp32_model'] for r in rs):.4f} | "
              f"{statistics.mean(r['train_s'] for r in rs):.0f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--work", default="runs/bench_outer")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=[])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:key=value,... (gossip settings; repeatable)")  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.what == "run":
        if not args.variants and not args.variant:
            raise SystemExit("name at least one --variants or --variant")
        run(args)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
