"""The weights of units kept on the card: their only copy is the unit's device slot.

A unit both kept on the device across steps (`swap.resident_units`) and updated there
(`swap.card_update`) is "card-kept": its slot is allocated when the engine is built, filled
once from the initial weights (or a checkpoint) and never released; its card update writes
the new weights into it and sends nothing of them back. The host keeps what the card does
not hold: no compute copy at all, and where the state's master is the bf16 weights
themselves (compact: the master's upper half, beside the host's int16 remainder) no master
either. Everything else that reads or writes the weights (checkpoints, resume, peers'
merges, evaluation's load) comes here, a unit at a time, holding the unit's lock:

    read    D2H of the slot through the backend's staging pool, a staging chunk's worth
            at a time (so a peer's read never holds chunks that a step's own copies wait
            for); the copy waits for the unit's last device write (`after`: the marker the
            card update records on the side stream, or a host write's copy event)
    write   H2D into the slot after the compute issued so far (which may still read it)
            and after the unit's last update; the compute stream then waits for the copy
            (what computes next, this step or the next, sees the new weights), and the
            host source is kept until the copy has read it

The lock is what keeps a read from racing the unit's update: the update holds it from its
first read of the state until its last piece has landed (atom/swap/card_update.py). A
write from outside a step (a peer's merge) also waits for the step to end (`gate`, held by
a step and an evaluation: `stepping`): a kernel of the step may read the slot at any time,
and a write under it would hand that kernel half-old, half-new weights. A read needs no
such wait (the step's kernels only read the slot; its update holds the lock).
"""

from __future__ import annotations

import functools
import threading

import torch

from atom.swap.backend import Backend, Transfer, done_transfer
from atom.swap.slots import DeviceSlots


def copied(t: Transfer) -> None:
    """Wait until a copy to the device has read its host source."""
    t.issued.wait()
    if t.cuda_event is not None:
        t.cuda_event.synchronize()


def stepping(method):
    """An engine method that runs the card-kept slots' kernels (a step, an evaluation):
    writes from other threads wait for it to return (`CardKept.gate`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.store.card.gate:
            return method(self, *args, **kwargs)

    return run


class CardKept:
    def __init__(self, backend: Backend, slots: DeviceSlots, units: frozenset[int], abort=None):
        """`units`: the card-kept units, whose slots are held from now on. `abort` raises
        the host worker's error while a read waits for a staging chunk (the worker is
        what hands them back)."""
        self.backend, self.slots, self.units, self.abort = backend, slots, units, abort
        for u in sorted(units):
            slots.hold(u)
        self.after: dict[int, object] = {}  # unit -> marker after its slot's last write
        # held by a step or evaluation; a write from another thread takes it before the
        # unit's lock (the step takes unit locks inside it): HostStore.shared_unit
        self.gate = threading.RLock()
        self.bytes_read = self.bytes_written = 0  # over the bus (tests, benchmarks)

    def updated(self, unit: int, marker: object) -> None:
        """The unit's card update has issued its last write of the slot before `marker`."""
        self.after[unit] = marker

    def read(self, unit: int, n: int) -> torch.Tensor:
        """The first `n` elements of the unit's slot, on the host, in the slot's dtype.
        The caller holds the unit's lock."""
        slot = self.slots.flat_of(unit)[:n]
        out = torch.empty(n, dtype=slot.dtype)
        pool = self.backend.staging_bytes()
        # about one staging chunk a copy (CudaBackend's pool has 8): a read from a peer's
        # thread then never holds chunks that the step's own copies wait for
        step = n if pool is None else max(1, pool // 8 // slot.element_size())
        for start in range(0, n, step):
            t = self.backend.d2h(slot[start : start + step], self.after.get(unit), self.abort)
            try:
                for offset, host in self.backend.host_pieces(t):
                    at = start + offset
                    out[at : at + host.numel()].copy_(host)
            finally:
                self.backend.release_host(t)
        self.bytes_read += out.nbytes
        return out

    def write(self, unit: int, values: torch.Tensor) -> None:
        """Set the first len(values) elements of the unit's slot from host `values` (any
        float dtype: converted on the host first). The caller holds the unit's lock."""
        slot = self.slots.flat_of(unit)
        src = values.to(slot.dtype).contiguous()  # kept until the copy has read it (below)
        last = self.after.get(unit)
        if last is not None:  # the unit's last update (side stream) before the compute marker
            waits = done_transfer()
            waits.cuda_event = last
            self.backend.wait_compute(waits)
        t = self.backend.h2d(slot[: src.numel()], src, self.backend.record(), [])
        self.backend.wait_compute(t)  # the compute issued from now on reads the new weights
        copied(t)
        self.after[unit] = t.cuda_event
        self.bytes_written += src.nbytes
