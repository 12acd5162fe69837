"""What a swap engine shows outside its steps: checkpoints (weights and optimizer state a
unit at a time), resume, the run state a checkpoint carries, and the units peers average.

Every reader first waits for the host worker (a step's last updates may still be queued),
then reads a unit under its lock, so a peer's merge never lands half-way through a copy.
A unit kept on the card is read from and written to its device slot (the store's reads and
writes go through atom/swap/card_kept.py), still a unit at a time under its lock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atom.ground.engine_protocol import EngineInfo, SharedUnit
from atom.optim import STATE_KEYS
from atom.swap.host_store import gather_owned


class EngineState:
    """Mixed into SwapEngine, which provides store, optimizers, worker, scaler,
    eager_clip, backend, ledger, tier, wdisk, units and cfg."""

    def wait_idle(self) -> None:
        self.worker.drain()
        self.store.wait_all_ready()

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 master parameters by model name (views into the host store; copies where
        it keeps the weights otherwise: compact, paged, or on the card)."""
        self.wait_idle()
        return self.store.named_master()

    def state_files(self):
        """(stem, tensors) per unit for checkpoint.save_checkpoint: weights, optimizer."""
        self.wait_idle()
        for u, (buf, opt) in enumerate(zip(self.store.buffers, self.optimizers, strict=True)):
            # One consistent snapshot per unit: peers may merge into master between steps,
            # under this lock, so copy weights and state while holding it (one unit of RAM).
            with self.store.paged_in(u, dirty=False), buf.lock:
                master = self.store.read_master(u)
                states = {key: opt.state_flat(key) for key in STATE_KEYS}
            tensors = dict(buf.spec.owned_views(master))
            for key, flat in states.items():
                if flat is not None:
                    for name, view in buf.spec.owned_views(flat).items():
                        tensors[f"optim.{key}.{name}"] = view
            yield f"unit_{buf.spec.index:03d}", tensors

    def optimizer_steps(self) -> int:
        """Updates applied so far. Waits for the host worker: right after train_step the
        last step's updates may still be queued (a checkpoint's meta read the count before
        its tensors and resumed with Adam's bias correction one step behind)."""
        self.wait_idle()
        return self.optimizers[0].steps

    def run_state(self) -> dict:
        """A checkpoint's small state: the fp16 loss scale, and what swap.update=eager
        carries between steps (the last norm and the clip coefficient it set: without
        them a resumed eager run clips its first step unlike the unbroken run)."""
        self.wait_idle()
        return {"loss_scale": self.scaler.scale if self.scaler else None,
                "clip": self.eager_clip.state()}  # fmt: skip

    def load_run_state(self, state: dict) -> None:
        """Raises ValueError/TypeError for values that are not numbers (a damaged meta)."""
        clip, scale = state.get("clip") or {}, state.get("loss_scale")
        if clip:
            self.eager_clip.load(clip)
        if scale and self.scaler is not None:
            self.scaler.scale = float(scale)

    def load_state(self, get: Callable[[str], torch.Tensor], has_optim: bool, steps: int) -> None:
        """Copy weights (and optimizer state) from a checkpoint, by model name."""
        self.wait_idle()
        for u, (buf, opt) in enumerate(zip(self.store.buffers, self.optimizers, strict=True)):
            with self.store.paged_in(u, fresh=True, weights=True), buf.lock:
                self.store.load_master(u, get)
                if has_optim:
                    for key in STATE_KEYS:
                        flat = gather_owned(buf.spec, get, f"optim.{key}.")
                        opt.load_state_flat(key, flat, steps)
                self.store.refresh_compute(u)

    def shared_units(self) -> list[SharedUnit]:
        """Every unit's weights, for peers to average (under the units' locks)."""
        return [self.store.shared_unit(i) for i in range(len(self.units))]

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def info(self) -> EngineInfo:
        s, tier = self.cfg.swap, self.tier
        mode = f"swapped: {len(self.units)} units, {s.layers_per_unit} layer(s)/unit, " \
               f"prefetch {s.prefetch}"  # fmt: skip
        if self.card_units:
            kept = f", {len(self.persistent)} kept there across steps" if self.persistent else ""
            mode += f"; {len(self.card_units)} updated on the device{kept}"
        disk = (
            f"{tier.disk_bytes / 2**30:.2f} GiB on disk in {tier.dir}"
            + ("" if tier.direct else " (buffered: this filesystem refuses O_DIRECT)")
            if tier
            else ""
        )
        if self.wdisk is not None:
            disk += f"; the compute copy of {len(self.wdisk.units)} unit(s) there too, " \
                    f"{self.wdisk.tier.disk_bytes / 2**30:.2f} GiB"  # fmt: skip
        return EngineInfo(mode, self.backend.pinned_bytes, disk)

    def device_peak_bytes(self) -> int:
        return self.backend.peak_allocated() or self.ledger.peak
