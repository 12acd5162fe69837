"""The passes of one unit visit (forward, the head's forward and backward, a unit's
backward), and where a checkpointed unit input waits between its forward and its backward:
on the device, or in host memory (`swap.offload_activations`) except for the last
`swap.acts_on_card` block units, whose backward comes first; of the offloaded ones, those
of the `swap.disk_acts` units on the NVMe tier (atom/swap/activations.py), written behind
the forward and read ahead of the backward, in the backward's order.

Every input kept on the device is counted in the memory ledger from its forward to its
backward; an offloaded one is not (it is in host memory, or on disk, meanwhile).
"""

from __future__ import annotations

import torch

from atom.ground.errors import ConfigError
from atom.swap.activations import INPUT_SLOTS, ActivationDisk
from atom.swap.card_update import unit_indices
from atom.swap.schedule import StepPlan
from atom.swap.slots import Held, params_saved_by_slot
from atom.swap.units import param_leaves, run_unit

ON_DISK = "on disk"  # what a step keeps for an input that waits on the NVMe tier


class UnitPasses:
    """Mixed into SwapEngine, which provides cfg, units, backend, slots and ledger."""

    def _offloaded(self, u: int) -> bool:
        """Unit u's checkpointed input waits in host memory: a block unit (the embedding's
        input is the batch), not one of the last `acts_on_card` block units."""
        s = self.cfg.swap
        last_offloaded = len(self.units) - 2 - s.acts_on_card  # the head is units[-1]
        return s.checkpoint and s.offload_activations and 0 < u <= last_offloaded

    def _disk_input_units(self) -> set[int]:
        """`swap.disk_acts` as unit indices: offloaded units only ("all": every one)."""
        offloaded = {u for u in range(len(self.units)) if self._offloaded(u)}
        try:
            chosen = unit_indices(self.cfg.swap.disk_acts, "swap.disk_acts", len(self.units))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if chosen is None:
            return offloaded
        if chosen - offloaded:
            raise ConfigError(
                f"swap.disk_acts: unit {min(chosen - offloaded)}'s input is not offloaded "
                f"(offloaded: block units 1-{max(offloaded, default=0)}, with "
                "swap.acts_on_card); name offloaded units only"
            )
        return chosen

    def _inputs_for_step(self, plan: StepPlan, n_micro: int) -> None:
        """Before a step: the disk inputs' place for this many micro-batches, and the
        order its backward will read them in."""
        if not self.disk_inputs:
            return
        keys = [(u, m) for u in sorted(self.disk_inputs) for m in range(n_micro)]
        if self.acts is not None and set(self.acts.keys) != set(keys):
            self.acts.close()  # another grad_accum: another layout
            self.acts = None
        self._acts_keys = keys
        self._acts_order = [
            (v.unit, v.micro) for v in plan.visits if v.phase == "b" and v.unit in self.disk_inputs
        ]
        self._acts_next = 0
        self._acts_put: set = set()  # this step's, so far

    def _put_on_disk(self, u: int, m: int, h: torch.Tensor) -> None:
        if self.acts is None:  # the first step: the hidden state's shape is known now
            self.acts = ActivationDisk(
                self.cfg.swap.disk_dir, self._acts_keys, tuple(h.shape), h.dtype, INPUT_SLOTS,
                alloc=self.backend.alloc_host_many if self.backend.pins_host else None,
                device=h.device, streams=self.backend.pins_host,
            )  # fmt: skip
        self.acts.put((u, m), h)
        self._acts_put.add((u, m))

    def _get_from_disk(self, u: int, m: int) -> torch.Tensor:
        order, i = self._acts_order, self._acts_next
        assert order[i] == (u, m), f"unit input {(u, m)} asked out of order (next {order[i]})"
        # read ahead, in the order they are got, what this step's forward has put so far
        # (micro-batch-major: the next micro-batch's inputs are not written yet, and a read
        # holding a slot for one would also starve that forward's writes of slots)
        for key in order[i : i + INPUT_SLOTS]:
            if key not in self._acts_put:
                break
            self.acts.prefetch(key)
        self._acts_next = i + 1
        return self.acts.get((u, m))

    def _forward_unit(self, u: int, m: int, flat, h, saved: dict, docs) -> torch.Tensor:
        if self.cfg.swap.checkpoint:
            if u in self.disk_inputs:
                self._put_on_disk(u, m, h)
                saved[u, m] = ON_DISK
            elif self._offloaded(u):
                saved[u, m] = self.backend.offload(h)  # kept in host memory until backward
            else:
                saved[u, m] = h
                if u > 0:
                    self.ledger.add(h.nbytes)
            with torch.no_grad():
                return run_unit(self.units[u], flat, h, docs=docs)
        held = Held(self.ledger)
        h_in = h if u == 0 else h.detach().requires_grad_()
        leaves = param_leaves(self.units[u], flat)
        with params_saved_by_slot(self.slots, u, held.add):
            out = run_unit(self.units[u], leaves, h_in, docs=docs)
        saved[u, m] = (h_in, out, leaves, held)
        return out.detach()

    def _head_step(self, u, flat, h, y, scale, docs):
        held = Held(self.ledger)
        h_in = h.detach().requires_grad_()
        leaves = param_leaves(self.units[u], flat)
        with params_saved_by_slot(self.slots, u, held.add):
            loss = run_unit(self.units[u], leaves, h_in, y, docs)
        grad_h, *grads = torch.autograd.grad(loss * scale, [h_in, *leaves])
        self.ledger.add(sum(g.nbytes for g in grads))  # until posted or accumulated
        held.release()
        return loss, grad_h, grads

    def _backward_unit(self, u: int, m: int, flat, grad_h, saved: dict, docs):
        unit = self.units[u]
        ckpt = self.cfg.swap.checkpoint
        offloaded = self._offloaded(u)
        if ckpt:
            x = saved.pop((u, m))
            if u in self.disk_inputs:
                x = self._get_from_disk(u, m)
            elif offloaded:
                x = self.backend.fetch(x)
            held = Held(self.ledger)
            h_in = x if u == 0 else x.detach().requires_grad_()
            leaves = param_leaves(unit, flat)
            with params_saved_by_slot(self.slots, u, held.add, None if offloaded else h_in):
                out = run_unit(unit, leaves, h_in, docs=docs)
        else:
            h_in, out, leaves, held = saved.pop((u, m))
        if u == 0:
            grad_in, grads = None, torch.autograd.grad(out, leaves, grad_h)
        else:
            grad_in, *grads = torch.autograd.grad(out, [h_in, *leaves], grad_h)
        self.ledger.add(sum(g.nbytes for g in grads))  # until posted or accumulated
        held.release()
        if ckpt and u > 0 and not offloaded:
            self.ledger.sub(h_in.nbytes)
        return grad_in, grads
