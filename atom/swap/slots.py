"""DeviceSlots: the fixed pool of device buffers that unit parameters are loaded into;
MemoryLedger: the engine's account of the device bytes it holds (slots and activations).

The pool size is the resident bound: nothing else of the parameters is ever on the
device. Each slot moves through free -> loading -> resident -> free; transitions are
asserted, and `max_resident` records the most slots ever holding a unit, so tests can
check the bound held rather than trust it.

Shared slots (prefetch + 1 of them) are each as large as the largest unit and take any
unit; a unit kept on the device (`swap.resident_units`) has a slot of its own, sized to it:
a 24 GB card holds Llama 3.1 8B's 32 blocks that way, where slots of its embedding's size
(a 128k vocabulary: 2.4x a block) would not. One that is updated on the card too is held
(`hold`) from the engine's start to its close: the slot is its weights' only home.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.swap.backend import Backend, Transfer

FREE, LOADING, RESIDENT = "free", "loading", "resident"


@dataclass
class Slot:
    index: int
    flat: torch.Tensor
    state: str = FREE
    unit: int | None = None
    transfer: Transfer | None = None
    last_use: object | None = None  # compute marker after the last kernel that read it
    owner: int | None = None  # the unit a dedicated slot is for (None: shared)


class DeviceSlots:
    def __init__(
        self,
        backend: Backend,
        n_slots: int,
        numel: int,
        dtype: torch.dtype,
        dedicated: dict[int, int] | None = None,
    ):
        """`n_slots` shared slots of `numel` elements; `dedicated`: unit -> its own slot's
        elements."""
        if n_slots < 1:
            raise ValueError("need at least one device slot")
        self.backend = backend
        self.slots = [Slot(i, backend.alloc_device(numel, dtype)) for i in range(n_slots)]
        for unit, n in sorted((dedicated or {}).items()):
            self.slots.append(Slot(len(self.slots), backend.alloc_device(n, dtype), owner=unit))
        self._own = {s.owner: s for s in self.slots if s.owner is not None}
        item = torch.empty(0, dtype=dtype).element_size()
        self._bytes = sum(s.flat.numel() for s in self.slots) * item
        self._where: dict[int, Slot] = {}
        self.max_resident = 0
        self.loads = 0
        self.bytes_loaded = 0  # host->device parameter bytes, counted per copy
        # Seconds compute waited for a unit's copy, and of that, while the copy itself was
        # still waiting for the host optimizer to release the unit (optimizer exposed).
        self.load_wait_s = 0.0
        self.optimizer_wait_s = 0.0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def resident_units(self) -> list[int]:
        return sorted(self._where)

    def has(self, unit: int) -> bool:
        return unit in self._where

    def flat_of(self, unit: int) -> torch.Tensor:
        return self._where[unit].flat

    def has_free(self) -> bool:
        return any(s.state == FREE for s in self.slots)

    def load(self, unit: int, src: torch.Tensor, host_ready, locks=()) -> Slot:
        """Start copying a unit's compute buffer into a free slot (asynchronous)."""
        assert unit not in self._where, f"unit {unit} is already on the device"
        slot = self._own.get(unit) or next(
            (s for s in self.slots if s.state == FREE and s.owner is None), None
        )
        assert slot is not None and slot.state == FREE, (
            "no free device slot: the schedule broke the resident bound"
        )
        slot.state, slot.unit = LOADING, unit
        slot.transfer = self.backend.h2d(
            slot.flat[: src.numel()], src, slot.last_use, host_ready, locks
        )
        self._where[unit] = slot
        self.loads += 1
        self.bytes_loaded += src.nbytes
        self.max_resident = max(self.max_resident, len(self._where))
        return slot

    def hold(self, unit: int) -> torch.Tensor:
        """The unit's own slot, resident from now on with no copy into it: its contents
        are the caller's to write (a card-kept unit, atom/swap/card_kept.py)."""
        slot = self._own[unit]
        assert slot.state == FREE and unit not in self._where
        slot.state, slot.unit = RESIDENT, unit
        self._where[unit] = slot
        self.max_resident = max(self.max_resident, len(self._where))
        return slot.flat

    def acquire(self, unit: int) -> torch.Tensor:
        """Make compute wait for the unit's copy; return the slot's flat buffer."""
        slot = self._where[unit]
        if slot.state == LOADING:
            t0 = time.perf_counter()
            self.backend.wait_compute(slot.transfer)
            waited = time.perf_counter() - t0
            self.load_wait_s += waited
            self.optimizer_wait_s += min(waited, slot.transfer.ready_wait_s)
            slot.state, slot.transfer = RESIDENT, None
        assert slot.state == RESIDENT
        return slot.flat

    def release(self, unit: int) -> None:
        """Free a unit's slot; a later copy into it waits for the compute issued so far."""
        slot = self._where.pop(unit)
        if slot.state == LOADING:  # never used: still wait for its copy before reuse
            self.backend.wait_compute(slot.transfer)
        slot.last_use = self.backend.record()
        slot.state, slot.unit, slot.transfer = FREE, None, None

    def release_all(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Free every slot but those of the units in `keep` (kept on the device across
        steps)."""
        for unit in list(self._where):
            if unit not in keep:
                self.release(unit)

    def close(self) -> None:
        """Drop the device buffers (an engine's close): nothing can be loaded after."""
        self._where.clear()
        for slot in self.slots:
            slot.flat = slot.last_use = slot.transfer = None
            slot.state = "closed"


class MemoryLedger:
    """The engine's own account of device bytes: slots + activations it keeps alive."""

    def __init__(self, base: int = 0):
        self.base = base
        self.current = base
        self.peak = base

    def add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def sub(self, n: int) -> None:
        self.current -= n

    def reset_peak(self) -> None:
        self.peak = self.current


class Held:
    """Device bytes a unit's saved activations hold, in the ledger from when autograd saves
    them until `release()` (after the unit's backward)."""

    def __init__(self, ledger: MemoryLedger):
        self.ledger, self.n = ledger, 0

    def add(self, n: int) -> None:
        self.n += n
        self.ledger.add(n)

    def release(self) -> None:
        self.ledger.sub(self.n)
        self.n = 0


@dataclass
class _ParamRef:
    """What the pack hook saves instead of a parameter tensor: where it sits in its unit."""

    unit: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def params_saved_by_slot(slots: DeviceSlots, unit: int, held: Callable[[int], None],
                         counted: torch.Tensor | None = None):  # fmt: skip
    """saved_tensors_hooks for a unit's forward: a parameter (a view of the unit's slot) is
    saved as where it sits, and unpacked from the slot the backward acquires (never a
    copy); every other storage autograd saves is reported to `held` once, by its bytes,
    except `counted` (a checkpointed unit input the ledger already holds)."""
    slot_flat = slots.flat_of(unit)
    slot_ptr = slot_flat.untyped_storage().data_ptr()
    seen: set[int] = set()
    if counted is not None:
        seen.add(counted.untyped_storage().data_ptr())

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr == slot_ptr:  # a parameter (or a view of one): save where, not what
            return _ParamRef(
                unit, t.size(), t.stride(), t.storage_offset() - slot_flat.storage_offset()
            )
        if ptr not in seen:
            seen.add(ptr)
            held(t.untyped_storage().nbytes())
        return t

    def unpack(obj):
        if isinstance(obj, _ParamRef):
            flat = slots.acquire(obj.unit)
            return flat.as_strided(obj.size, obj.stride, flat.storage_offset() + obj.offset)
        return obj

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
