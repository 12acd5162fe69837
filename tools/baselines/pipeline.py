"""GPipe pipeline parallel: torch.distributed.pipelining over gloo, one stage per rank.

    python -m tools.baselines.pipeline --rank R --world 4 --master HOST:PORT --out DIR \
        --seconds 90 --data DATA_DIR --micro 4 --chunks 8 --set model.n_layer=4 ...

The model's blocks are cut into `world` consecutive stages (the embedding joins the
first, the head and loss the last). Each step takes a batch of micro x chunks sequences,
split into `chunks` micro-batches that flow through the stages in GPipe order (all
forwards, then all backwards); activations (micro x seq_len x d_model) cross every stage
boundary forward and their gradients cross back. Gradients are clipped by the global
norm (one all-reduced scalar) and every stage takes its own AdamW step. Rank 0 and the
last rank read the same batch (data seed train.seed), so the math is sync SGD on one
model at micro x chunks sequences per step.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from atom.config import Config
from atom.data.tokens import TokenData
from atom.model import LanguageModel, lm_loss
from tools.baselines import common

log = logging.getLogger(__name__)


def split_blocks(n_layer: int, stages: int) -> list[range]:
    """Consecutive, as-even-as-possible runs of blocks; earlier stages get the extra ones
    except that the last stage (which also runs the head) is never the largest."""
    if stages > n_layer:
        raise SystemExit(f"{stages} stages need at least {stages} layers, got {n_layer}")
    base, extra = divmod(n_layer, stages)
    sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


class Stage(nn.Module):
    """embed (first stage) -> blocks[k] -> head (last stage)."""

    def __init__(self, model: LanguageModel, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first_block = blocks.start
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def full_state(self) -> dict[str, torch.Tensor]:
        """Parameters under their names in the full LanguageModel."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("blocks."):
                _, k, rest = name.split(".", 2)
                name = f"blocks.{self.first_block + int(k)}.{rest}"
            out[name] = t.detach().clone()
        return out


def build_stage(cfg: Config, rank: int, world: int) -> Stage:
    model = common.full_model(cfg)  # same init as every other system, then keep our part
    ranges = split_blocks(cfg.model.n_layer, world)
    return Stage(model, ranges[rank], rank == 0, rank == world - 1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, targets)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__.split("\n")[0])
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--chunks", type=int, default=8, help="micro-batches per step (M)")
    args = ap.parse_args(argv)
    cfg = common.setup(args)
    rank, world = args.rank, args.world
    first, last = rank == 0, rank == world - 1
    stage_mod = build_stage(cfg, rank, world)
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=args.chunks, loss_fn=loss_fn)
    opt = common.optimizer(stage_mod, cfg)
    batch = args.micro * args.chunks
    data = TokenData(common.data_dir(args, cfg), cfg.model.seq_len, seed=cfg.train.seed)
    run = common.Run(args, tokens_per_step=batch * cfg.model.seq_len)
    params = list(stage_mod.parameters())
    run.start()
    step = 0
    while True:
        common.apply_lr(opt, step, cfg)
        loss = None
        if first or last:
            x, y = data.train_batch(step, 0, batch)
        if first:
            schedule.step(x)
        elif last:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            loss = float(torch.stack(losses).mean())
        else:
            schedule.step()
        common.global_grad_norm_clip(params, cfg.train.grad_clip, group_sum=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        action = run.end_step(step, loss)
        step += 1
        if action != common.CONTINUE:
            run.snapshot(step, stage_mod.full_state())
        if action == common.STOP:
            break
    log.info("pipeline stage %d: %d steps in %.1f s", rank, step, run.wall)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
