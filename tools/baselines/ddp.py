"""Synchronous data parallel: torch DistributedDataParallel over gloo, one rank per peer.

    python -m tools.baselines.ddp --rank R --world 4 --master HOST:PORT --out DIR \
        --seconds 90 --data DATA_DIR --set model.n_layer=4 --set model.tie_embeddings=false ...

Every rank holds the whole model, draws its own batch of train.micro_batch sequences
(data seed train.seed + rank), and all-reduces gradients (DDP's buckets overlap the
backward) before an identical AdamW step: sync SGD at world x micro_batch sequences per
step. Started four at a time by tools/bench/vs_pipeline.py, one per network namespace.
"""

from __future__ import annotations

import logging
import sys

from torch.nn.parallel import DistributedDataParallel as DDP

from atom.data.tokens import TokenData
from tools.baselines import common

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    args = common.parser(__doc__.split("\n")[0]).parse_args(argv)
    cfg = common.setup(args)
    tc = cfg.train
    model = common.full_model(cfg)
    ddp = DDP(model, bucket_cap_mb=25)
    opt = common.optimizer(model, cfg)
    data = TokenData(common.data_dir(args, cfg), cfg.model.seq_len, seed=tc.seed + args.rank)
    run = common.Run(args, tokens_per_step=args.world * tc.micro_batch * cfg.model.seq_len)
    params = [p for p in model.parameters()]
    run.start()
    step = 0
    while True:
        common.apply_lr(opt, step, cfg)
        x, y = data.train_batch(step, 0, tc.micro_batch)
        _, loss = ddp(x, y)
        loss.backward()
        common.global_grad_norm_clip(params, tc.grad_clip, group_sum=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        action = run.end_step(step, float(loss))
        step += 1
        if action != common.CONTINUE and args.rank == 0:
            run.snapshot(step, model.state_dict())
        if action == common.STOP:
            break
    log.info("ddp: %d steps in %.1f s", step, run.wall)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
