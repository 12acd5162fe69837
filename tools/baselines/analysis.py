"""Turn the runs of tools/bench/vs_pipeline.py into numbers, tables and figures.

    .venv/bin/python -m tools.bench.vs_pipeline report [--work DIR] [--docs docs]

- every snapshot (ddp, pipeline: merged stages; atom: each peer's checkpoints) is
  evaluated on one fixed validation set (16 batches of 16 sequences, data seed 0);
- throughput: tokens per training second after the first 10% of the run (group total);
- atom's convergence per token, eta: the tokens the sync-SGD reference needed to reach
  the loss an atom run reached, over the tokens the atom group used (median over its
  later snapshots); tau: optimizer steps between two averagings of one unit on a peer
  (steps x units / exchanges the peer took part in); tau0 of the simulator's
  eta(tau) = 1/N + (1 - 1/N) tau0 / (tau0 + tau) is fitted to the measured pairs;
- the simulator (profiler/simulate.py) is fed the one-thread profile.json, every
  compute cost scaled by processes / cores, and predicts tokens/s and time-to-loss for
  each run; the table gives the error.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

import torch

from tools.jsonl import read_records

log = logging.getLogger(__name__)

VAL_BATCHES, VAL_BATCH, VAL_SEED = 16, 16, 0
LABEL = {"atom": "atom (outer optimizer, int8)", "atom-avg": "atom (plain averaging)",
         "pipeline": "GPipe pipeline", "ddp": "DDP (sync all-reduce)"}  # fmt: skip
COLOR = {"atom": "tab:green", "atom-avg": "tab:olive", "pipeline": "tab:orange",
         "ddp": "tab:blue"}  # fmt: skip


class Evaluator:
    """Validation loss of a parameter dict, cached by file name and mtime."""

    def __init__(self, work: Path):
        from atom.config import load_config
        from atom.data.tokens import TokenData
        from atom.model import build_model, materialize
        from tools.baselines.settings import overrides

        torch.set_flush_denormal(True)
        self.cfg = load_config(None, overrides())
        data = Path((work / "data.txt").read_text().strip())
        self.batches = TokenData(data, self.cfg.model.seq_len, VAL_SEED).val_batches(
            VAL_BATCHES, VAL_BATCH
        )
        self.model = materialize(build_model(self.cfg.model), seed=0).eval()
        self.cache_path = work / "evals.json"
        self.cache = json.loads(self.cache_path.read_text()) if self.cache_path.exists() else {}

    def loss(self, key: str, load) -> float:
        if key in self.cache:
            return self.cache[key]
        from atom.model import lm_loss

        self.model.load_state_dict(load(), strict=True)
        with torch.no_grad():
            total = sum(float(lm_loss(self.model(x)[0], y)) for x, y in self.batches)
        self.cache[key] = total / len(self.batches)
        return self.cache[key]

    def save(self) -> None:
        self.cache_path.write_text(json.dumps(self.cache, indent=0) + "\n")


def _key(*paths: Path) -> str:
    return "|".join(f"{p}@{p.stat().st_mtime_ns}" for p in paths)


def _throughput(points: list[tuple[float, float]]) -> float:
    """Tokens per second over (wall, tokens) after the first 10% of the run."""
    end_wall, end_tokens = points[-1]
    start = next(p for p in points if p[0] >= 0.1 * end_wall)
    if end_wall <= start[0]:
        return end_tokens / end_wall
    return (end_tokens - start[1]) / (end_wall - start[0])


def baseline_run(ev: Evaluator, run: Path, system: str, peers: int) -> dict:
    ranks = [0] if system == "ddp" else list(range(peers))
    curve = []
    for snap in read_records(run / "snapshots.jsonl"):
        files = [run / f"snap_{snap['step']:08d}_rank{r}.pt" for r in ranks]
        if not all(f.exists() for f in files):
            continue

        def load(files=files) -> dict:
            state: dict = {}
            for f in files:
                state.update(torch.load(f, weights_only=True))
            return state

        val = ev.loss(_key(*files), load)
        curve.append({"wall_s": snap["wall_s"], "tokens": snap["tokens"], "val_loss": val,
                      "step": snap["step"]})  # fmt: skip
    metrics = read_records(run / "metrics_rank0.jsonl")
    return {
        "curve": curve,
        "steps": metrics[-1]["step"] if metrics else 0,
        "wall_s": metrics[-1]["wall_s"] if metrics else 0.0,
        "tokens_per_s": _throughput([(r["wall_s"], r["tokens"]) for r in metrics])
        if metrics
        else 0.0,
        "median_step_s": statistics.median(r["step_time_s"] for r in metrics) if metrics else 0,
    }


def atom_run(ev: Evaluator, run: Path, peers: int, n_units: int) -> dict:
    from atom.store.checkpoint import load_checkpoint

    per_peer, rates, taus, exchanges, sent = [], [], [], [], []
    tokens_per_step = ev.cfg.train.micro_batch * ev.cfg.model.seq_len
    for i in range(peers):
        peer = run / f"peer{i}"
        metrics = read_records(peer / "metrics.jsonl")
        if not metrics:
            continue
        wall, walls = 0.0, {}
        for r in metrics:
            wall += r["step_time_s"]
            walls[r["step"]] = wall
        rates.append(_throughput([(walls[r["step"]], r["step"] * tokens_per_step)
                                  for r in metrics]))  # fmt: skip
        last = metrics[-1]
        try:  # bytes this peer sent per optimizer step (gossip.json, written as it ran)
            wire = json.loads((peer / "gossip.json").read_text()).get("wire") or {}
        except (OSError, json.JSONDecodeError):
            wire = {}
        if wire.get("sent_per_step") is not None:
            sent.append(wire["sent_per_step"])
        ex = last.get("gossip", {}).get("exchanges", 0)
        exchanges.append(ex)
        taus.append(last["step"] * n_units / ex if ex else math.inf)
        points = {}
        for ckpt in sorted((peer / "checkpoints").glob("step_*")):
            step = int(ckpt.name.split("_")[1])
            if step not in walls:
                continue

            def load(ckpt=ckpt) -> dict:
                c = load_checkpoint(ckpt)
                return {n: c.get(n) for n in c.names() if not n.startswith("optim.")}

            points[step] = (walls[step], ev.loss(_key(ckpt / "meta.json"), load))
        per_peer.append(points)
    common = sorted(set.intersection(*(set(p) for p in per_peer))) if per_peer else []
    curve = [
        {
            "step": s,
            "wall_s": statistics.mean(p[s][0] for p in per_peer),
            "tokens": s * tokens_per_step * len(per_peer),
            "val_loss": statistics.mean(p[s][1] for p in per_peer),
            "val_losses": [p[s][1] for p in per_peer],
        }
        for s in common
    ]
    finals = [max(p) for p in per_peer]  # the checkpoint each peer saved on SIGINT
    if finals and finals[-1] not in common:
        curve.append({
            "step": statistics.mean(finals),
            "wall_s": statistics.mean(p[max(p)][0] for p in per_peer),
            "tokens": sum(finals) * tokens_per_step,
            "val_loss": statistics.mean(p[max(p)][1] for p in per_peer),
            "val_losses": [p[max(p)][1] for p in per_peer],
        })  # fmt: skip
    return {
        "curve": curve,
        "steps": statistics.mean(finals) if finals else 0,
        "wall_s": curve[-1]["wall_s"] if curve else 0.0,
        "tokens_per_s": sum(rates),
        "tau_steps": statistics.median(taus) if taus else math.inf,
        "exchanges": exchanges,
        "sent_bytes_per_step": statistics.mean(sent) if sent else None,
    }


# ------------------------------------------------------------------ convergence
def reference_curve(ev: Evaluator, work: Path) -> list[tuple[float, float]]:
    """(tokens, val loss) of sync SGD at the group's batch, made monotone (running min)."""
    run = work / "reference"
    out, best = [(0.0, math.log(ev.cfg.model.vocab_size))], math.inf
    for snap in read_records(run / "snapshots.jsonl"):
        f = run / f"snap_{snap['step']:08d}_rank0.pt"
        if f.exists():
            val = ev.loss(_key(f), lambda f=f: torch.load(f, weights_only=True))
            best = min(best, val)
            out.append((float(snap["tokens"]), best))
    return out


def sync_tokens(ref: list[tuple[float, float]], loss: float) -> float | None:
    """Tokens the reference needed to reach `loss` (linear between snapshots); None if it
    never did."""
    for (t0, l0), (t1, l1) in zip(ref, ref[1:], strict=False):
        if l1 <= loss <= l0:
            return t0 if l0 == l1 else t0 + (t1 - t0) * (l0 - loss) / (l0 - l1)
    return None


def measured_eta(ref: list[tuple[float, float]], curve: list[dict]) -> float | None:
    if not curve:
        return None
    end = curve[-1]["tokens"]
    ratios = []
    for p in curve:
        if p["tokens"] < 0.25 * end:
            continue
        need = sync_tokens(ref, p["val_loss"])
        if need is not None:
            ratios.append(need / p["tokens"])
    return statistics.median(ratios) if ratios else None


def fit_tau0(pairs: list[tuple[float, float]], peers: int) -> float:
    """Least squares over a log grid of tau0 for eta(tau) against measured (tau, eta)."""
    from atom.profiler.simulate import efficiency

    grid = [10 ** (k / 20) for k in range(-40, 81)]  # 0.01 .. 10^4
    return min(grid, key=lambda t0: sum((efficiency(t, peers, t0) - e) ** 2 for t, e in pairs))


def time_to_loss(curve: list[dict], loss: float) -> float | None:
    """First wall time at which the curve reaches `loss` (linear between snapshots)."""
    prev = None
    for p in curve:
        if p["val_loss"] <= loss:
            if prev is None or prev["val_loss"] == p["val_loss"]:
                return p["wall_s"]
            f = (prev["val_loss"] - loss) / (prev["val_loss"] - p["val_loss"])
            return prev["wall_s"] + f * (p["wall_s"] - prev["wall_s"])
        prev = p
    return None
