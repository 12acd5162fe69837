"""Host AdamW for one unit: torch's fused AdamW (or DeepSpeedCPUAdam) over its flat fp32 master.

The swap engine keeps one optimizer per unit over that unit's flat master buffer
(two groups: matrices decayed, vectors not), so a unit can be updated the moment its
gradients land. The resident reference uses the same factory over named parameters,
which keeps the two numerically the same.
"""

from __future__ import annotations

import logging

import torch

from atom.config import TrainConfig
from atom.optim.state import ADAM_EPS, STATE_KEYS, Region

log = logging.getLogger(__name__)


def make_optimizer(
    decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: TrainConfig
) -> torch.optim.Optimizer:
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": cfg.weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "deepspeed":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as err:
            raise RuntimeError(
                "train.optimizer=deepspeed needs DeepSpeed: pip install 'atom[deepspeed]'"
            ) from err
        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=betas, adamw_mode=True)
    # fused: one kernel over the whole flat buffer; measured ~6x faster than the default
    # loop on CPU and as fast as DeepSpeedCPUAdam (FIELD_NOTES.md).
    fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=ADAM_EPS, fused=fused)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def export_state(
    opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], views: dict[str, callable]
) -> dict[str, torch.Tensor]:
    """Optimizer state as {f'{key}/{name}': tensor}; `views[name](state_tensor)` picks the
    param's slice from its group's state tensor."""
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        state = opt.state.get(param)
        if not state:
            continue
        for key in STATE_KEYS:
            out[f"{key}/{name}"] = views[name](state[key])
    return out


def optimizer_step_count(opt: torch.optim.Optimizer) -> int:
    for state in opt.state.values():
        step = state.get("step")
        if step is not None:
            return int(step.item() if torch.is_tensor(step) else step)
    return 0


def init_state(opt: torch.optim.Optimizer, param: torch.Tensor, step: int) -> dict:
    """Create an empty-but-valid state for `param` so a checkpoint can be copied into it."""
    state = opt.state[param]
    if not state:
        if isinstance(opt, torch.optim.AdamW):
            # where torch's own load_state_dict puts it: on the parameter's device for the
            # fused and capturable kernels (fused CUDA AdamW refuses a CPU step: a resumed
            # --resident run on a GPU crashed at its first step), else on the CPU
            group = next(g for g in opt.param_groups if any(p is param for p in g["params"]))
            on_param = group.get("fused") or group.get("capturable")
            device = param.device if on_param else torch.device("cpu")
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
        else:
            state["step"] = step
        for key in STATE_KEYS:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


class TorchUnitOptimizer:
    """One unit's torch AdamW (or DeepSpeedCPUAdam) over its flat fp32 master and gradient:
    the decayed parameters first, then the rest, as two groups. The swap engine sees this
    and atom.optim.compact.CompactAdamW through the same members.

    paged: master is a placeholder the disk tier points into a RAM slot around each update
    (atom/swap/disk_tier.py); the moments are placeholders too, created up front so that
    `regions` can name them. `moments`: flat (exp_avg, exp_avg_sq) buffers to hold the
    state (page-locked ones, for a unit updated on the device), zeroed here. An empty
    `grad`: the unit is updated on the device (atom/swap/card_update.py, from its
    begin_card_step), which keeps the gradient; `step` is never called for it."""

    def __init__(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        n_owned: int,
        n_decay: int,
        cfg: TrainConfig,
        paged: bool = False,
        moments: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.n_owned, self.n_decay = n_owned, n_decay
        self.master = master
        self.decay, self.no_decay = master[:n_decay], master[n_decay:]
        self._params = [p for p, n in ((self.decay, n_decay), (self.no_decay, n_owned - n_decay))
                        if n]  # fmt: skip
        self.grad = grad[:n_owned]
        self.on_card = grad.numel() == 0  # no host gradient to attach (torch checks sizes)
        self._grads = {id(self.decay): grad[:n_decay], id(self.no_decay): grad[n_decay:n_owned]}
        if not paged and not self.on_card:
            self._attach_grads()
        self.opt = make_optimizer(
            [self.decay] if n_decay else [], [self.no_decay] if n_owned - n_decay else [], cfg
        )
        if paged:
            for p in self._params:
                state = self.opt.state[p]
                state["step"] = torch.tensor(0.0)
                for key in STATE_KEYS:
                    state[key] = torch.empty(0)
        elif moments is not None:  # as torch would make them at the first step, in place
            for p in self._params:
                at = 0 if p is self.decay else n_decay
                state = self.opt.state[p]
                state["step"] = torch.tensor(0.0)
                for key, flat in zip(STATE_KEYS, moments, strict=True):
                    state[key] = flat[at : at + p.numel()].zero_()

    def regions(self) -> list:
        """The unit's cold state for the disk tier: master (with the two group views of
        it), then each moment over the same layout."""
        n, k = self.n_owned, self.n_decay
        parts = [(p, 0 if p is self.decay else k, (k if p is self.decay else n - k,))
                 for p in self._params]  # fmt: skip
        out = [Region(torch.float32, n, [(self.master, 0, (n,)), *parts])]
        for key in STATE_KEYS:
            out.append(
                Region(
                    torch.float32,
                    n,
                    [(self.opt.state[p][key], at, shape) for p, at, shape in parts],
                )  # fmt: skip
            )
        return out

    @property
    def steps(self) -> int:
        return optimizer_step_count(self.opt)

    def _attach_grads(self) -> None:
        # paged: a parameter has its size only while the disk tier points it into a slot
        for p in self._params:
            p.grad = self._grads[id(p)]

    def begin_card_step(self) -> tuple[float, list[tuple[torch.Tensor, ...]]]:
        """The step the card update (atom/swap/card_update.py) is about to make, as the
        host step would make it: the step count advanced (torch advances it before its
        kernel), and per group (master view, exp_avg, exp_avg_sq, weight decay, betas), the
        moments created as zeros on the first step."""
        steps = self.steps
        groups = []
        for group in self.opt.param_groups:
            (p,) = group["params"]
            state = init_state(self.opt, p, steps)
            state["step"] += 1  # a tensor in place, or an int rebound
            groups.append((p, state["exp_avg"], state["exp_avg_sq"], group["weight_decay"],
                           group["betas"]))  # fmt: skip
        return float(steps + 1), groups

    def step(self, lr: float, coef: float = 1.0) -> None:
        assert not self.on_card, "a unit updated on the device has no host gradient to step on"
        if coef != 1.0:
            self.grad.mul_(coef)
        self._attach_grads()
        set_lr(self.opt, lr)
        self.opt.step()

    def state_flat(self, key: str) -> torch.Tensor | None:
        parts = [self.opt.state[p][key] for p in self._params if p in self.opt.state]
        return torch.cat(parts) if parts else None

    def load_state_flat(self, key: str, flat: torch.Tensor, steps: int) -> None:
        offset = 0
        for p in self._params:
            state = init_state(self.opt, p, steps)
            state[key].copy_(flat[offset : offset + p.numel()])
            if torch.is_tensor(state["step"]):
                state["step"].fill_(steps)
            else:
                state["step"] = steps
            offset += p.numel()
