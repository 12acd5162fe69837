"""HostStore: the whole model in host memory, one set of flat buffers per unit.

Per unit:
  master   owned params only: what the optimizer updates and checkpoints save; fp32, or
           bf16 with `rem` (swap.state: compact, atom/optim/compact.py); bf16 alone
           (swap.state: bf16, atom/optim/bf16.py: the weights are the master)
  rem      compact only: int16, the fp32 master's low bits; master + rem is the fp32
           master exactly (atom/optim/remainder.py)
  grad     owned + aliases: gradients land here (accumulated over micro-batches); fp32,
           bf16 when compact. Empty for a unit updated on the device (`card`): its
           gradient is summed and used there and never reaches the host
  compute  compute dtype, owned + aliases: the only thing that crosses the bus; pinned on
           CUDA. When it has master's dtype and the unit has no aliases, it *is* master.
  ready    set when the host optimizer is done with the unit, so an H2D copy never reads
           a half-updated buffer
  lock     held while master is written (optimizer step, loading, peer averaging)

With a disk tier (swap.disk_dir, atom/swap/disk_tier.py) master and rem are placeholders
that point into a RAM slot only while the unit is paged in (`paged`), and compute is always
its own buffer: what stays in RAM is compute and grad (none for card units). With
`swap.disk_weights` a card unit's compute is a placeholder too, on a tier of its own.

A unit kept on the card (`kept`: resident across steps and updated there) has no compute
copy on the host: its device slot is the copy (atom/swap/card_kept.py, `card`). Where the
state's master is that bf16 copy itself (compact: its upper half; `master_on_card`), the
host has no master either, only the remainder: reads and writes of the weights go through
the slot. An fp32 master stays on the host (it is the state, not the weights' copy).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from atom.config import ModelConfig
from atom.ground.engine_protocol import SharedUnit
from atom.model import init_parameter
from atom.optim.remainder import join, split_into
from atom.swap.backend import Backend
from atom.swap.units import UnitSpec


def gather_owned(spec: UnitSpec, get, prefix: str = "") -> torch.Tensor:
    """A unit's owned tensors from a checkpoint (`get(prefix + name)`), flat fp32 in the
    unit's order."""
    flat = torch.zeros(spec.n_owned)  # the padding between parameters stays zero
    for name, view in spec.owned_views(flat).items():
        view.copy_(get(prefix + name))
    return flat


def kept_host_bytes(spec: UnitSpec, compute_dtype: torch.dtype, state: str, paged: bool) -> int:
    """Host bytes HostStore does not allocate for a unit kept on the card (its weights live
    in its device slot): its compute copy where that is a buffer of its own, or the bf16
    master that is the copy itself. An fp32 master (state, not a copy) stays."""
    master_dtype = torch.float32 if state == "fp32" else torch.bfloat16
    same = compute_dtype == master_dtype and spec.n_total == spec.n_owned and not paged
    if not same:
        return spec.n_total * compute_dtype.itemsize
    return spec.n_owned * master_dtype.itemsize if master_dtype != torch.float32 else 0


@dataclass
class UnitBuffers:
    spec: UnitSpec
    master: torch.Tensor
    grad: torch.Tensor
    compute: torch.Tensor
    rem: torch.Tensor | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    compute_is_master: bool = False  # compute is master itself (one buffer, both roles)
    kept: bool = False  # kept on the card: compute is its device slot (no host buffer)
    master_on_card: bool = False  # kept, and master is that slot too (no host buffer)


class HostStore:
    def __init__(
        self,
        units: list[UnitSpec],
        backend: Backend,
        compute_dtype: torch.dtype,
        state: str = "fp32",
        paged: bool = False,
        card: frozenset[int] = frozenset(),
        disk_weights: frozenset[int] = frozenset(),
        kept: frozenset[int] = frozenset(),
    ):
        """`card`: units updated on the device, whose master (and remainder) cross the bus
        for their update too: page-locked with the compute copies (pageable memory copies
        at a fraction of the bus's rate). They have no host gradient (an empty one): 141 GB
        of bf16 on a compact 70B. They are never tied (card_update.eligible), so no alias
        gradient is folded into or out of them. `disk_weights`: units whose compute copy is
        a placeholder pointed into a slot of the weights tier (`wtier`, set by the engine)
        while paged in, like master with the state tier. `kept`: card units kept on the
        card, whose weights live in their device slot (`card`, set by the engine before
        any weight is written): nothing is allocated here for what the slot holds."""
        self.units = units
        self.compute_dtype = compute_dtype
        self.compact = state == "compact"
        self.bf16 = state == "bf16"  # bf16 master, no remainder
        self.master_dtype = torch.bfloat16 if self.compact or self.bf16 else torch.float32
        # a bf16 master is the weights themselves (compact: beside a remainder); an fp32
        # one is optimizer state, kept on the host whatever the card holds
        self.master_is_weights = self.master_dtype != torch.float32
        self.paged = paged
        self.card = None  # CardKept, with kept units (atom/swap/card_kept.py)
        self.tier = None  # the DiskTier, when paged (set by the engine once it is built)
        self.wtier = None  # the weights' DiskTier, with disk_weights (atom/swap/weights.py)
        self.disk_weights = disk_weights
        self.buffers: list[UnitBuffers] = []
        # what crosses the bus, asked for at once: one pinned arena on CUDA. master is that
        # buffer when it doubles as the compute copy (same dtype, no tied aliases).
        shares = [
            compute_dtype == self.master_dtype and u.n_total == u.n_owned and not paged
            for u in units
        ]
        on_card = {u.index for u, same in zip(units, shares, strict=True)
                   if u.index in kept and same and self.master_is_weights}  # fmt: skip
        # no host compute copy: on the weights tier, or kept on the card (unless it is an
        # fp32 master, which stays)
        bare = {u.index for u, same in zip(units, shares, strict=True) if not same} & kept
        no_copy = disk_weights | on_card | bare
        requests = [
            (u.n_owned, self.master_dtype) if same else (u.n_total, compute_dtype)
            for u, same in zip(units, shares, strict=True)
            if u.index not in no_copy
        ]
        crossing: dict[tuple[int, str], int] = {}  # (unit, what) -> index in requests
        for u, same in zip(units, shares, strict=True):
            if u.index in card and not paged:
                if not same:
                    crossing[u.index, "master"] = len(requests)
                    requests.append((u.n_owned, self.master_dtype))
                if self.compact:
                    crossing[u.index, "rem"] = len(requests)
                    requests.append((u.n_owned, torch.int16))
        bus = backend.alloc_host_many(requests) if requests else []
        computes = iter(bus[: len(units) - len(no_copy)])
        for spec, same in zip(units, shares, strict=True):
            if spec.index in no_copy:  # pointed in by the weights tier, or on the card
                dtype = self.master_dtype if spec.index in on_card else compute_dtype
                on_bus = torch.empty(0, dtype=dtype)
            else:
                on_bus = next(computes)
            n = 0 if paged else spec.n_owned  # paged: placeholders until the tier points them
            master = on_bus if same else torch.empty(n, dtype=self.master_dtype)
            if (spec.index, "master") in crossing:
                master = bus[crossing[spec.index, "master"]]
            grad = torch.zeros(0 if spec.index in card else spec.n_total, dtype=self.master_dtype)
            rem = torch.zeros(n, dtype=torch.int16) if self.compact else None
            if (spec.index, "rem") in crossing:
                rem = bus[crossing[spec.index, "rem"]].zero_()
            flags = {"kept": spec.index in kept, "master_on_card": spec.index in on_card}
            buf = UnitBuffers(spec, master, grad, on_bus, rem, compute_is_master=same, **flags)
            buf.ready.set()
            self.buffers.append(buf)

    def __len__(self) -> int:
        return len(self.buffers)

    @contextmanager
    def paged_in(self, index: int, dirty: bool = True, fresh: bool = False, weights=False):
        """Unit's master (and, through the tier, its optimizer state) in RAM for the body;
        written back afterwards if `dirty`. `fresh`: the body sets master and moments
        anew (zeros unless set), so nothing is read. `weights`: the compute copy too, where
        it is on the weights tier (the body refreshes it). A no-op without a disk tier."""
        wtier = self.wtier if weights and index in self.disk_weights else None
        if wtier is not None:
            wtier.acquire(index, fresh)
        try:
            if self.tier is None:
                yield
                return
            self.tier.acquire(index, fresh)
            try:
                yield
            finally:
                self.tier.release(index, dirty)
        finally:
            if wtier is not None:
                wtier.release(index, dirty)

    def init_weights(self, cfg: ModelConfig, seed: int) -> None:
        for i, buf in enumerate(self.buffers):
            values = torch.zeros(buf.spec.n_owned)  # zero padding (units.py)
            for name, view in buf.spec.owned_views(values).items():
                init_parameter(name, view, cfg, seed)
            with self.paged_in(i, fresh=True, weights=True):
                self.write_master(i, values)
                self.refresh_compute(i)

    # Master as fp32 values, whatever the layout. Callers that race the optimizer or a
    # peer merge hold the unit's lock.
    def read_master(self, index: int) -> torch.Tensor:
        """A copy of the unit's weights in fp32 (master joined with rem when compact; a
        master on the card copied down first)."""
        buf = self.buffers[index]
        master = self.card.read(index, buf.spec.n_owned) if buf.master_on_card else buf.master
        if buf.rem is None:
            return master.to(torch.float32, copy=True)
        return join(master, buf.rem)

    def write_master(self, index: int, values: torch.Tensor) -> None:
        """Set the unit's weights from fp32 values (compact: split into the nearest bf16
        and its remainder, so read_master gives `values` back bit for bit; a master on the
        card is written there, the compute copy with it)."""
        buf = self.buffers[index]
        if buf.master_on_card:
            upper = torch.empty(buf.spec.n_owned, dtype=self.master_dtype)
            if buf.rem is None:
                upper.copy_(values)
            else:
                split_into(values.float().contiguous(), upper, buf.rem)
            self.card.write(index, upper)
        elif self.compact:
            split_into(values.float().contiguous(), buf.master, buf.rem)
        else:
            buf.master.copy_(values)

    def load_master(self, index: int, get) -> None:
        """Set the unit's weights from `get(name)` (a checkpoint's fp32 tensors), one
        tensor at a time: fp32 master takes them in place, with no unit-sized copy."""
        buf = self.buffers[index]
        if not (self.compact or buf.master_on_card):
            for name, view in buf.spec.owned_views(buf.master).items():
                view.copy_(get(name))
            return
        self.write_master(index, gather_owned(buf.spec, get))

    def add_master(self, index: int, delta: torch.Tensor) -> None:
        if self.compact or self.buffers[index].master_on_card:
            self.write_master(index, self.read_master(index).add_(delta))
        else:
            self.buffers[index].master.add_(delta)

    def refresh_compute(self, index: int) -> None:
        """Copy a unit's master into its compute buffer (its device slot, kept on the
        card), and into every alias of it."""
        buf = self.buffers[index]
        if buf.kept:
            if not buf.master_on_card:  # a master on the card was written there already
                self.card.write(index, buf.master)
        elif not buf.compute_is_master:
            buf.compute[: buf.spec.n_owned].copy_(buf.master)
        for other in self.buffers:
            for entry in other.spec.aliases:
                owner, offset = entry.alias_of
                if owner == index:
                    src = buf.master[offset : offset + entry.numel]
                    other.compute[entry.offset : entry.offset + entry.numel].copy_(src)

    def shared_unit(self, index: int) -> SharedUnit:
        """Unit `index` as peers see it (atom.ground.engine_protocol.SharedUnit): fp32 read, add and
        write of its master, each under the unit's lock, the compute copy refreshed."""
        buf = self.buffers[index]
        # a unit kept on the card is written between steps (card_kept.py: the gate)
        gate = self.card.gate if buf.kept else nullcontext()

        def read() -> torch.Tensor:
            with buf.lock:
                return self.read_master(index)

        def add(delta: torch.Tensor) -> None:
            with gate, buf.lock:
                self.add_master(index, delta)
                self.refresh_compute(index)

        def write(values: torch.Tensor) -> None:
            with gate, buf.lock:
                self.write_master(index, values)
                self.refresh_compute(index)

        params = tuple((p.full_name, p.shape) for p in buf.spec.owned)
        return SharedUnit(index, params, buf.spec.n_owned, read, add, write)

    def fold_alias_grads(self, index: int) -> None:
        """Add the gradients that alias holders computed for this unit's params."""
        buf = self.buffers[index]
        for other in self.buffers:
            for entry in other.spec.aliases:
                owner, offset = entry.alias_of
                if owner == index:
                    buf.grad[offset : offset + entry.numel].add_(
                        other.grad[entry.offset : entry.offset + entry.numel]
                    )

    def named_master(self) -> dict[str, torch.Tensor]:
        """fp32 weights by model name: views into master (copies when compact, paged or on
        the card, each read under the unit's lock)."""
        out: dict[str, torch.Tensor] = {}
        for i, buf in enumerate(self.buffers):
            if self.compact or self.bf16 or self.paged or buf.master_on_card:
                with self.paged_in(i, dirty=False), buf.lock:
                    values = self.read_master(i)
            else:
                values = buf.master
            out.update(buf.spec.owned_views(values))
        return out

    def wait_all_ready(self, timeout: float = 600.0) -> None:
        for buf in self.buffers:
            if not buf.ready.wait(timeout):
                raise RuntimeError(f"unit {buf.spec.index} was not released by the optimizer")

    def nbytes(self) -> int:
        total = 0
        for buf in self.buffers:
            total += buf.master.nbytes + buf.grad.nbytes
            if buf.rem is not None:
                total += buf.rem.nbytes
            if not buf.compute_is_master:
                total += buf.compute.nbytes
        return total
