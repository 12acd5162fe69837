"""What the baseline trainers share: arguments, the process group, the model and optimizer
atom would build, a stop/snapshot signal from rank 0, and the run record.

Each baseline runs one process per rank, started by tools/bench/vs_pipeline.py inside its
own network namespace (or by hand on loopback):

    python -m tools.baselines.ddp --rank R --world 4 --master 127.0.0.1:29500 \
        --out runs/ddp --seconds 60 --set model.n_layer=4 ...

Records written under --out (rank R's files carry its number):
    metrics_rank{R}.jsonl    one line per step: step, wall_s (training time so far,
                             snapshots excluded), step_time_s, tokens (group total so far),
                             loss (this rank's local loss where it has one)
    snapshots.jsonl          rank 0: step, wall_s, tokens of every snapshot
    snap_{step}_rank{R}.pt   the model parameters this rank holds at that step
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from atom.config import Config, load_config
from atom.model import LanguageModel, build_model, materialize
from atom.optim import lr_at, make_optimizer, set_lr

log = logging.getLogger(__name__)

CONTINUE, SNAPSHOT, STOP = 0, 1, 2


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, metavar="HOST:PORT", help="rank 0's address")
    ap.add_argument("--iface", default=None, help="GLOO_SOCKET_IFNAME (eth0 in a netshape node)")
    ap.add_argument("--out", required=True, help="run directory (shared by all ranks)")
    ap.add_argument("--seconds", type=float, default=60.0, help="training wall time")
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    ap.add_argument("--snapshot-s", type=float, default=10.0, help="snapshot every S seconds")
    ap.add_argument("--snapshot-steps", type=int, default=0, help="snapshot every N steps instead")
    ap.add_argument("--data", default=None, help="dataset directory (default: train.data)")
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    return ap


def setup(args: argparse.Namespace) -> Config:
    """Threads, logging, config, and the gloo process group (10 min timeout)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s: %(message)s"
    )
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    cfg = load_config(args.config, args.overrides)
    if cfg.model.tied:
        raise SystemExit("baselines need model.tie_embeddings=false (a tied head spans stages)")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(minutes=10),
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return cfg


def data_dir(args: argparse.Namespace, cfg: Config) -> Path:
    from atom.run.train import data_dir_for

    return Path(args.data) if args.data else data_dir_for(cfg)


def full_model(cfg: Config) -> LanguageModel:
    """The model atom would train, initialised from train.seed (identical on every rank)."""
    model = materialize(build_model(cfg.model), seed=cfg.train.seed)
    model.train()
    return model


def optimizer(module: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """atom's AdamW: matrices decayed, vectors not."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return make_optimizer(decay, no_decay, cfg.train)


def apply_lr(opt: torch.optim.Optimizer, step: int, cfg: Config) -> None:
    set_lr(opt, lr_at(step, cfg.train))


def global_grad_norm_clip(params: list[torch.Tensor], max_norm: float, group_sum: bool) -> float:
    """Clip by the global norm; with group_sum the squared norm is summed over ranks (each
    rank holds a different part of the model, as pipeline stages do)."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros(()) if not grads else sum(g.pow(2).sum() for g in grads)
    sq = torch.as_tensor(sq, dtype=torch.float32).reshape(1)
    if group_sum:
        dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


class Run:
    """Rank 0's clock decides, every step, whether to go on, snapshot or stop; the decision
    is broadcast (one int) so all ranks snapshot and stop at the same step."""

    def __init__(self, args: argparse.Namespace, tokens_per_step: int):
        self.args = args
        self.rank = args.rank
        self.out = Path(args.out)
        self.tokens_per_step = tokens_per_step
        self.wall = 0.0  # training seconds so far (snapshot writing excluded)
        self.next_snapshot = args.snapshot_s
        self._t = time.perf_counter()
        self._metrics = (self.out / f"metrics_rank{self.rank}.jsonl").open("w")
        self._flag = torch.zeros(1, dtype=torch.int64)

    def start(self) -> None:
        dist.barrier()
        self._t = time.perf_counter()

    def end_step(self, step: int, loss: float | None) -> int:
        """Close step `step` (0-based); returns CONTINUE, SNAPSHOT or STOP for all ranks."""
        if self.rank == 0:
            now = time.perf_counter()
            wall = self.wall + (now - self._t)
            action = CONTINUE
            if wall >= self.args.seconds or step + 1 >= self.args.max_steps:
                action = STOP
            elif self.args.snapshot_steps > 0:
                if (step + 1) % self.args.snapshot_steps == 0:
                    action = SNAPSHOT
            elif wall >= self.next_snapshot:
                action = SNAPSHOT
                self.next_snapshot = wall + self.args.snapshot_s
            self._flag[0] = action
        dist.broadcast(self._flag, src=0)
        now = time.perf_counter()
        step_time = now - self._t
        self.wall += step_time
        self._t = now
        record = {
            "step": step + 1,
            "wall_s": self.wall,
            "step_time_s": step_time,
            "tokens": (step + 1) * self.tokens_per_step,
        }
        if loss is not None:
            record["loss"] = loss
        self._metrics.write(json.dumps(record) + "\n")
        return int(self._flag[0])

    def snapshot(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """Save this rank's parameters (named as in the full model); not timed."""
        t0 = time.perf_counter()
        torch.save(state, self.out / f"snap_{step:08d}_rank{self.rank}.pt")
        if self.rank == 0:
            with (self.out / "snapshots.jsonl").open("a") as f:
                row = {"step": step, "wall_s": self.wall,
                       "tokens": step * self.tokens_per_step}  # fmt: skip
                f.write(json.dumps(row) + "\n")
        self._metrics.flush()
        self._t += time.perf_counter() - t0  # snapshot time is not training time

    def close(self) -> None:
        self._metrics.close()
        dist.barrier()
        dist.destroy_process_group()
