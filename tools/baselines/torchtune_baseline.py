"""torchtune's single-device full fine-tune, rebuilt on atom's model: the baseline a
hobbyist compares atom with (issue 27; torchtune's Llama 3.1 8B on an RTX 4090, 1,650
tokens/s in 18.9 GiB).

    python -m tools.baselines.torchtune_baseline --config llama-3.1-8b --set model.n_layer=8 \
        --gpu-mem 24GiB --batch 2 --steps 4

prints one JSON line: tokens/s (median step), device peak bytes, host RSS, the optimizer
used. What it does, as torchtune's full_finetune_single_device recipe with its 8B config:

- bf16 weights on the device and nothing else of the model: no fp32 master, no host copy;
- every block's activations checkpointed (torch.utils.checkpoint, non-reentrant);
- the optimizer stepped inside the backward (torchtune's optimizer_in_bwd): one optimizer
  per parameter, stepped by its post-accumulate-grad hook, the gradient freed at once, so
  a whole set of gradients never exists; hence no accumulation and no clipping;
- bitsandbytes' PagedAdamW8bit where it imports (torchtune's choice), else torchao's
  AdamW8bit, else torch's AdamW (`--optimizer` picks one; the output says which ran).

Not torchtune's: torch.compile, and the data (random tokens: the baseline is timed, not
trained to a loss). The loss is atom's chunked cross-entropy, as torchtune's is chunked.
On the CPU it runs too (tests: fp32, torch's AdamW), where it equals a plain loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import psutil
import torch
from torch.utils.checkpoint import checkpoint

from atom.config import Config, load_config
from atom.ground.sizes import parse_bytes
from atom.model import build_model, materialize
from atom.model.head_loss import head_loss

OPTIMIZERS = ("auto", "paged8bit", "ao8bit", "adamw")


def make_optimizer(kind: str, cfg: Config):
    """(the name of what runs, a factory of one optimizer over a list of parameters)."""
    tc = cfg.train
    kw = {"lr": tc.lr, "betas": (tc.beta1, tc.beta2), "weight_decay": tc.weight_decay}
    if kind in ("auto", "paged8bit"):
        try:
            import bitsandbytes as bnb

            return "bitsandbytes PagedAdamW8bit", lambda ps: bnb.optim.PagedAdamW8bit(ps, **kw)
        except ImportError:
            if kind == "paged8bit":
                raise
    if kind in ("auto", "ao8bit"):
        try:
            from torchao.optim import AdamW8bit

            return "torchao AdamW8bit", lambda ps: AdamW8bit(ps, **kw)
        except ImportError:
            if kind == "ao8bit":
                raise
    return "torch AdamW", lambda ps: torch.optim.AdamW(ps, **kw)


class OptimizerInBackward:
    """One optimizer per parameter, stepped as soon as that parameter's gradient is
    complete (a post-accumulate-grad hook), and the gradient dropped right after."""

    def __init__(self, model: torch.nn.Module, factory):
        self.opts = {}
        for p in model.parameters():
            self.opts[p] = factory([p])
            p.register_post_accumulate_grad_hook(self._step)

    def _step(self, p: torch.Tensor) -> None:
        self.opts[p].step()
        self.opts[p].zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for opt in self.opts.values():
            for group in opt.param_groups:
                group["lr"] = lr


def build(cfg: Config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """atom's model, atom's init, in `dtype` on the device: the weights and nothing else."""
    return materialize(build_model(cfg.model), cfg.train.seed, device=device).to(dtype)


def loss_of(model, x: torch.Tensor, y: torch.Tensor, recompute: bool = True) -> torch.Tensor:
    h = model.embed(x)
    for block in model.blocks:
        h = checkpoint(block, h, use_reentrant=False) if recompute else block(h)
    return head_loss(model.head, h, y)  # torchtune's chunked cross-entropy, as atom's


def batches(cfg: Config, batch: int, steps: int, device: torch.device):
    g = torch.Generator().manual_seed(cfg.train.seed)
    shape = (batch, cfg.model.seq_len + 1)
    for _ in range(steps):
        seq = torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def run(cfg: Config, device: torch.device, dtype: torch.dtype, batch: int, steps: int,
        optimizer: str = "auto", warmup: int = 1) -> dict:  # fmt: skip
    model = build(cfg, device, dtype)
    name, factory = make_optimizer(optimizer, cfg)
    _stepper = OptimizerInBackward(model, factory)  # its hooks step inside the backward
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i, (x, y) in enumerate(batches(cfg, batch, steps, device)):
        t0 = time.perf_counter()
        loss = loss_of(model, x, y)
        loss.backward()  # the optimizer steps in here, parameter by parameter
        losses.append(float(loss.detach()))  # a host sync: the step has finished
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times) if times else float("nan")
    return {
        "optimizer": name,
        "dtype": str(dtype).replace("torch.", ""),
        "batch": batch,
        "seq_len": cfg.model.seq_len,
        "step_s": step_s,
        "tokens_per_s": batch * cfg.model.seq_len / step_s,
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "host_rss_bytes": psutil.Process().memory_info().rss,
        "losses": losses,
        "step_times_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama-3.1-8b")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--gpu-mem", default=None, help="cap device memory, e.g. 24GiB")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (no accumulation)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    if device.type == "cuda" and args.gpu_mem:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.gpu_mem) / total))
    cfg = load_config(args.config, args.overrides)
    try:
        result = run(cfg, device, dtype, args.batch, args.steps, args.optimizer)
    except torch.cuda.OutOfMemoryError as err:
        result = {"error": f"out of device memory at batch {args.batch}: {str(err)[:200]}"}
    result["config"] = args.config
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
