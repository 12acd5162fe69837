"""DeepSpeed ZeRO-3 with parameters and optimizer offloaded to CPU: the baseline that
bench_swap compares atom's swapped training with on a GPU (same model, batch, memory cap).

    python -m tools.bench_swap --config gpt3-2.7b --gpu-mem 24GiB --steps 6 --deepspeed

Needs CUDA and `pip install deepspeed` (its CPU Adam JIT-builds on first use). Runs in
this single process (world size 1, torch.distributed over gloo on loopback).
"""

from __future__ import annotations

import os
import time

import torch

from atom.config import Config
from atom.model import build_model, materialize


def deepspeed_tokens_per_s(cfg: Config, batches_for, steps: int, warmup: int) -> float:
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="gloo")
    tc = cfg.train
    ds_config = {
        "train_micro_batch_size_per_gpu": tc.micro_batch,
        "gradient_accumulation_steps": tc.grad_accum,
        "gradient_clipping": tc.grad_clip,
        "bf16": {"enabled": torch.cuda.is_bf16_supported()},
        "fp16": {"enabled": not torch.cuda.is_bf16_supported()},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": tc.lr, "betas": [tc.beta1, tc.beta2], "weight_decay": tc.weight_decay},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device="cpu"):
        model = materialize(build_model(cfg.model, device="cpu"), tc.seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    tokens = tc.micro_batch * tc.grad_accum * cfg.model.seq_len
    elapsed = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        for x, y in batches_for(i):
            _, loss = engine(x.cuda(), y.cuda())
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        if i >= warmup:
            elapsed.append(time.perf_counter() - t0)
    elapsed.sort()
    return tokens / elapsed[len(elapsed) // 2]
