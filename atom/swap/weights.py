"""DiskWeights: the compute copy (what crosses the bus to the device) of some card-updated
units on the NVMe tier (`swap.disk_weights`), for models whose bus copy does not fit RAM.

A second DiskTier holds one record per unit: its compute buffer, a placeholder that points
into a RAM slot only while the record is held (as master does with the state tier):

- a load acquires the record before its copy to the device, and gives it back clean once
  the copy has read the slot (the training thread hands it over when compute takes the
  unit; the tier's writer waits for the copy's CUDA event before freeing the slot). The
  copy reads a view of the slot of its own, so the record's tensor may be re-pointed
  meanwhile;
- loads are read ahead in the step's load order (schedule.load_order), READ_AHEAD of them
  beyond the one starting;
- the card update acquires the record fresh (it writes every element: nothing is read)
  and releases it dirty once its last piece has landed: one write a step. A load of the
  same unit while the update still holds it shares the slot (the tier counts holders) and
  its copy waits for the unit's `ready`, as from RAM.

Bytes a step: a streamed unit is read once per load (forward, backward reload: twice
unit-major, unless it stays on the device across the fwd/bwd turn) and written once.
Units must be card-updated (a host update would need the copy in RAM beside its master),
not resident (kept on the card: their weights live in their device slot, with no copy on
the host at all, atom/swap/card_kept.py) and not tied.
"""

from __future__ import annotations

import torch

from atom.ground.errors import ConfigError
from atom.optim import Region
from atom.swap.backend import Transfer
from atom.swap.card_kept import copied
from atom.swap.card_update import eligible, unit_indices
from atom.swap.disk_tier import DiskTier, UnitRecord
from atom.swap.schedule import StepPlan, load_order
from atom.swap.units import UnitSpec

# loads read ahead beyond those the device slots have started: a unit's read (a 70B block,
# 1.7 GB at a few GB/s) is far shorter than its compute, so one is enough, and each slot
# is a unit's weights of RAM
READ_AHEAD = 1


def weight_slots(prefetch: int) -> int:
    """RAM slots of the weights tier: the device slots' loads (prefetch + 1), the reads
    ahead, and one for a card update (it holds its unit's record until its last landing).
    Fewer could leave a load waiting for a slot only the training thread would free."""
    return prefetch + 1 + READ_AHEAD + 1


def disk_weight_units(spec: str, units: list[UnitSpec], card: set[int], resident: set[int]):
    """`swap.disk_weights` as unit indices ("all": every card-updated unit not resident).
    Raises ConfigError for a unit that is tied, host-updated or resident."""
    try:
        chosen = unit_indices(spec, "swap.disk_weights", len(units))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if chosen is None:
        return frozenset(card - resident)
    for u in sorted(chosen):
        if not eligible(units, u):
            why = "shares tied weights with another unit (its compute copy stays in RAM)"
        elif u not in card:
            why = "is updated on the host, which needs its compute copy in RAM (add it to "
            why += "swap.card_update, or leave it out)"
        elif u in resident:  # card-kept: its weights live in its device slot, none on the host
            why = "is resident and updated on the card: its weights live on the card, with "
            why += "nothing in RAM to put on the disk (leave it out, or lower swap.resident_units)"
        else:
            continue
        raise ConfigError(f"swap.disk_weights: unit {u} {why}")
    return frozenset(chosen)


class DiskWeights:
    def __init__(self, directory, units: frozenset[int], store, n_slots: int, alloc):
        records = {}
        for u in sorted(units):
            compute = store.buffers[u].compute
            n = store.buffers[u].spec.n_total
            records[u] = UnitRecord([Region(compute.dtype, n, [(compute, 0, (n,))])])
        self.tier = DiskTier(directory, records, n_slots, alloc)
        store.wtier = self.tier
        self.store, self.units = store, units
        self._copying: dict[int, Transfer] = {}  # loads whose copy may still read the slot
        # id(plan) -> (the plan, its loads of disk units); the plan is kept so that its id
        # is not reused by another (set_schedule drops the engine's plans)
        self._orders: dict[int, tuple[StepPlan, list[int]]] = {}
        self._order: list[int] = []
        self._next = 0

    def begin(self, plan: StepPlan, keep: set[int]) -> None:
        """A step (or an evaluation) starts: its loads are read ahead in this order."""
        key = id(plan)
        if key not in self._orders:
            order = load_order(plan.visits, plan.windows, keep)
            self._orders[key] = (plan, [u for u in order if u in self.units])
        self._order, self._next = self._orders[key][1], 0

    def source(self, u: int) -> torch.Tensor:
        """Before u's load: its record in a slot, the next loads' reads queued; returns the
        tensor the copy reads (a view of the slot of its own)."""
        self.tier.acquire(u)
        k = self._next
        if k < len(self._order) and self._order[k] == u:
            self._next = k + 1
            for v in self._order[k + 1 : k + 1 + READ_AHEAD]:
                self.tier.prefetch(v)
        return self.store.buffers[u].compute.view(-1)

    def loading(self, u: int, transfer: Transfer) -> None:
        self._copying[u] = transfer

    def taken(self, u: int) -> None:
        """Compute took u's copy: the record goes back clean once the copy has read it."""
        t = self._copying.pop(u, None)
        if t is not None:
            self.tier.release(u, dirty=False, after=lambda: copied(t))

    def abandon(self) -> None:
        """A step or evaluation cut short, the device slots freed (their copies done): every
        load's record goes back, then those read ahead for loads that will not come."""
        for u in list(self._copying):
            self.taken(u)
        self.tier.discard_unheld()
        self._order, self._next = [], 0
