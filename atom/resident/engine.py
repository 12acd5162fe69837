"""ResidentEngine: the same model trained the plain PyTorch way, everything on the device.

It is the reference the swap engine is tested against (same init, same optimizer groups,
same clipping) and the baseline benchmarks compare with. It speaks the engine interface
the training loop uses: train_step, evaluate, named_parameters, state_files, load_state.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from atom.config import Config, ConfigError
from atom.ground.engine_protocol import EngineInfo, SharedUnit, StepResult
from atom.model import build_model, materialize
from atom.model.compiled_blocks import compile_blocks, hidden_state, wanted
from atom.model.documents import micro_batch
from atom.model.head_loss import head_loss
from atom.optim import init_state, make_optimizer, optimizer_step_count, set_lr


class ResidentEngine:
    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        compute_dtype: torch.dtype,
        recompute: bool = False,
    ):
        self.cfg = cfg
        # recompute: activation checkpointing per block (torch.utils.checkpoint), the fair
        # baseline for a swapped run that recomputes (swap.checkpoint: true)
        self.recompute = recompute
        self.device = device
        self.dtype = compute_dtype
        self.committed = False  # during the optimizer step (engine_protocol.Engine)
        self.model = materialize(build_model(cfg.model), cfg.train.seed, device=device)
        self.params = dict(self.model.named_parameters())
        decay = [p for p in self.params.values() if p.dim() >= 2]
        no_decay = [p for p in self.params.values() if p.dim() < 2]
        self.opt = make_optimizer(decay, no_decay, cfg.train)
        self.scaler = torch.amp.GradScaler(device.type) if compute_dtype == torch.float16 else None
        self.blocks_compiled = False
        if wanted(cfg.train.compile_blocks, device):
            example = hidden_state(cfg, device, torch.float32)  # fp32 weights, autocast
            self.blocks_compiled = compile_blocks(
                list(self.model.blocks), example, context=self._autocast
            )
        self._activation_peak = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _counting_hooks(self, counter: list[int]):
        seen: set[int] = set()
        param_ptrs = {p.untyped_storage().data_ptr() for p in self.params.values()}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs and ptr not in seen:
                seen.add(ptr)
                counter[0] += t.untyped_storage().nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def train_step(self, batches, lr: float, stop=None) -> StepResult:
        """`stop`: asked between micro-batches; abandons the step (KeyboardInterrupt)."""
        set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for batch in batches:
            if stop is not None and stop():
                self.opt.zero_grad(set_to_none=True)
                raise KeyboardInterrupt
            x, y, docs = micro_batch(batch, self.device)
            counter = [0]
            with self._autocast(), self._counting_hooks(counter):
                loss = self._loss(x, y, docs)
            self._activation_peak = max(self._activation_peak, counter[0])
            scaled = loss / len(batches)
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach().float()
        self.committed = True  # Ctrl+C now waits for the update to finish
        try:
            if self.scaler:
                self.scaler.unscale_(self.opt)
            norm = None
            if self.cfg.train.grad_clip > 0:
                params = self.model.parameters()
                norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip))
            if self.scaler:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
        finally:
            self.committed = False
        return StepResult(loss=float(total) / len(batches), grad_norm=norm)

    def _loss(self, x: torch.Tensor, y: torch.Tensor, docs) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.model.embed(x, docs=docs)
        for block in self.model.blocks:
            if self.recompute:
                h = checkpoint(block, h, docs=docs, use_reentrant=False)
            else:
                h = block(h, docs=docs)
        return head_loss(self.model.head, h, y)  # as the swap engine's head: logits in chunks

    @torch.no_grad()
    def evaluate(self, batches, weights: list[float] | None = None) -> float:
        weights = weights or [1.0] * len(batches)
        total = 0.0
        for batch, weight in zip(batches, weights, strict=True):
            x, y, docs = micro_batch(batch, self.device)
            with self._autocast():
                _, loss = self.model(x, y, docs=docs)
            total += float(loss) * weight
        return total / sum(weights)

    def wait_idle(self) -> None:
        pass

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.params.items()}

    def state_files(self):
        tensors = {k: v.detach() for k, v in self.params.items()}
        for name, p in self.params.items():
            state = self.opt.state.get(p)
            if state:
                for key in ("exp_avg", "exp_avg_sq"):
                    tensors[f"optim.{key}.{name}"] = state[key]
        yield "resident", tensors

    def optimizer_steps(self) -> int:
        return optimizer_step_count(self.opt)

    @torch.no_grad()
    def load_state(self, get: Callable[[str], torch.Tensor], has_optim: bool, steps: int) -> None:
        for name, p in self.params.items():
            p.copy_(get(name))
            if has_optim:
                state = init_state(self.opt, p, steps)
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key].copy_(get(f"optim.{key}.{name}"))

    def run_state(self) -> dict:
        return {"loss_scale": None, "clip": None}  # plain PyTorch's own: nothing carried

    def load_run_state(self, state: dict) -> None:
        pass

    def shared_units(self) -> list[SharedUnit]:
        raise ConfigError("gossip averages the host master weights of the swap engine; "
                          "drop --resident")  # fmt: skip

    def info(self) -> EngineInfo:
        return EngineInfo("resident")

    def device_peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        held = sum(p.nbytes * 2 for p in self.params.values())  # weights + grads
        held += sum(
            t.nbytes for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)
        )
        return held + self._activation_peak

    def close(self) -> None:
        pass
