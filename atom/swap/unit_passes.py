"""The passes of one unit visit (forward, the head's forward and backward, a unit's
backward), and where a checkpointed unit input waits between its forward and its backward:
on the device, or in host memory (`swap.offload_activations`) except for the last
`swap.acts_on_card` block units, whose backward comes first.

Every input kept on the device is counted in the memory ledger from its forward to its
backward; an offloaded one is not (it is in host memory meanwhile).
"""

from __future__ import annotations

import torch

from atom.swap.slots import Held, params_saved_by_slot
from atom.swap.units import param_leaves, run_unit


class UnitPasses:
    """Mixed into SwapEngine, which provides cfg, units, backend, slots and ledger."""

    def _offloaded(self, u: int) -> bool:
        """Unit u's checkpointed input waits in host memory: a block unit (the embedding's
        input is the batch), not one of the last `acts_on_card` block units."""
        s = self.cfg.swap
        last_offloaded = len(self.units) - 2 - s.acts_on_card  # the head is units[-1]
        return s.checkpoint and s.offload_activations and 0 < u <= last_offloaded

    def _forward_unit(self, u: int, m: int, flat, h, saved: dict, docs) -> torch.Tensor:
        if self.cfg.swap.checkpoint:
            if self._offloaded(u):
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
            if offloaded:
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
