"""DeepSpeed baselines for atom on one GPU: the configurations a user would pick.

- ZeRO-2 with `offload_optimizer: cpu` (ZeRO-Offload) when the bf16 weights, their
  gradients and activations fit the card: the optimizer and fp32 master weights on the host.
- ZeRO-3 with `offload_param` + `offload_optimizer` on the CPU when they do not.

    python -m tools.baselines.deepspeed_baseline --config gpt3-2.7b --set model.vocab_size=256 \
        --gpu-mem 24GiB --batch 32 --micro-batch 8 --stage 3 --steps 3

prints one JSON line: tokens/s (median step), peak device bytes. tools/gpu_check runs it
(same model, cap and batch as atom's run) wherever DeepSpeed imports. Needs CUDA and
`pip install deepspeed` (its CPU Adam JIT-builds on first use, with nvcc and ninja). One
process, world size 1, NCCL on loopback.

Weights: DeepSpeed's own (module init inside `zero.Init` for ZeRO-3, partitioned as the
modules are built, so the full model is never materialised on the device): the baseline
is timed, not trained to a loss. `--recompute` checkpoints each block's activations (what
atom's plan does with swap.checkpoint), so both run at the same micro-batch; one that
runs out of device memory is halved (the batch kept by accumulation) until it fits, and
the micro-batch used is in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from atom.config import Config, load_config
from atom.ground.device import cuda_has_bf16
from atom.ground.sizes import parse_bytes
from atom.model import build_model


def ds_config(cfg: Config, stage: int) -> dict:
    tc = cfg.train
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    else:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    bf16 = cuda_has_bf16()  # as atom chooses: emulated bf16 is not bf16
    return {
        "train_micro_batch_size_per_gpu": tc.micro_batch,
        "gradient_accumulation_steps": tc.grad_accum,
        "gradient_clipping": tc.grad_clip,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": not bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": tc.lr, "betas": [tc.beta1, tc.beta2], "weight_decay": tc.weight_decay},
        },
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


class _Recomputed(torch.nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, *args, use_reentrant=False, **kwargs)


def run(cfg: Config, stage: int, steps: int, warmup: int = 1, recompute: bool = False) -> dict:
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl")
    config = ds_config(cfg, stage)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu"):
            model = build_model(cfg.model, device="cpu")
    else:
        model = build_model(cfg.model, device="cpu")
    if recompute:
        model.blocks = torch.nn.ModuleList(_Recomputed(b) for b in model.blocks)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch, cfg.model.seq_len + 1)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        for _ in range(cfg.train.grad_accum):
            seq = torch.randint(0, cfg.model.vocab_size, shape, generator=g).cuda()
            _, loss = engine(seq[:, :-1], seq[:, 1:])
            engine.backward(loss)
            engine.step()  # DeepSpeed counts micro-batches; it updates at the boundary
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = cfg.train.micro_batch * cfg.train.grad_accum * cfg.model.seq_len
    return {
        "stage": stage,
        "micro_batch": cfg.train.micro_batch,
        "recompute": recompute,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "device_peak_bytes": torch.cuda.max_memory_allocated(),
        "step_times_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt3-2.7b")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--gpu-mem", default=None, help="cap device memory, e.g. 24GiB")
    ap.add_argument("--batch", type=int, default=32, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--stage", type=int, choices=(2, 3), default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", action="store_true", help="checkpoint each block")
    args = ap.parse_args(argv)
    if args.batch % args.micro_batch:
        ap.error("--batch must be a multiple of --micro-batch")
    if args.gpu_mem:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.gpu_mem) / total))
    micro, tried = args.micro_batch, []
    while True:
        overrides = [*args.overrides, f"train.micro_batch={micro}",
                     f"train.grad_accum={args.batch // micro}"]  # fmt: skip
        cfg = load_config(args.config, overrides)
        oom = None
        try:
            result = run(cfg, args.stage, args.steps, recompute=args.recompute)
            break
        except torch.cuda.OutOfMemoryError as err:
            oom = str(err)[:200]  # not the exception: its traceback holds the failed engine
        tried.append(micro)
        _release()  # outside the except block, where the failed attempt can be freed
        if micro == 1 or args.batch % (micro // 2):
            result = {"stage": args.stage,
                      "error": f"out of device memory at micro-batch {tried}: {oom}"}  # fmt: skip
            break
        micro //= 2
    result["out_of_memory_at"] = tried
    print(json.dumps(result))
    return 0


def _release() -> None:
    """Free what a failed attempt left on the device before the next one."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
