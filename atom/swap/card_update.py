"""The update on the card: a unit's optimizer step run on the device, its gradient never
crossing the bus (`swap.card_update`).

The unit's optimizer state stays where the host update keeps it, in host memory (or on
the NVMe tier: paged into a RAM slot before the first chunk crosses, written back once
the last piece has landed), so checkpoints, `atom export`, peers' merges and the LR
schedule see it where they always did. For the update it crosses the bus a chunk at a
time, the next chunk's copy issued before this chunk's update runs (double-buffered):

    H2D (copy stream)   the chunk's state: fp32 master + both moments (fp32 state); the
                        bf16 master, its 16-bit remainder, the moments' codes and block
                        scales (compact state)
    compute stream      the chunk's AdamW (atom/optim/chunk_update.py), with the gradient
                        summed on the device
    D2H (staging pool)  the new state, and the new compute copy of the weights where it is
                        not the master itself; the host worker lands each piece in place.
                        A unit kept on the card (its weights' only home is its slot,
                        atom/swap/card_kept.py) sends no compute copy back, nor, where
                        the master is that copy (compact: its bf16 upper half), the master

The update's kernels and its copies' waits run on a side stream (Backend.side_stream),
so the backward of the next units goes on meanwhile; the next step's compute waits for
the side stream before it reads a slot the update wrote (Backend.join_side).

Bytes over the bus a parameter: 12 each way in fp32 state (+ the compute copy down, unless
kept on the card); in compact state about 4 up (+2 for the bf16 master where the slot
cannot supply it) and 4 down (+2 for the master where the host keeps it), against the host
update's gradient down and nothing up.

The unit's lock is held from the first read of its state until the last piece has
landed (a peer's merge in between would be overwritten, lost), and its `ready` event is
clear meanwhile (its next load waits for the new weights). Both are given back by the
last landing's cleanup, which the host worker runs whatever happens to the landings
(landed, failed, skipped after another job failed); before that is queued, a failure
gives them back here. A threading.Lock may be released by another thread than the one
that took it.

Units whose weights are tied to another unit's (GPT's tied embedding and head) keep their
update on the host: the tied gradient is folded across units there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from atom.optim.bf16 import Bf16Scratch
from atom.optim.chunk_update import bf16_chunk, compact_chunk, compact_scalars, fp32_chunk
from atom.optim.compact import BLOCK, CHUNK, padded
from atom.swap.backend import Backend
from atom.swap.host_store import HostStore
from atom.swap.host_worker import HostWorker
from atom.swap.slots import MemoryLedger
from atom.swap.units import UnitSpec

log = logging.getLogger(__name__)

# elements of a unit updated per chunk on the device: large enough that a chunk's dozen
# kernels and copies are not launch-bound, small enough that two chunks' state is a few
# hundred MiB at most (fp32 state: 12 bytes an element)
DEVICE_CHUNK = 8 * CHUNK
# chunks whose copies back straight into the host state may be in flight at once (what
# two chunks' share of the staging pool allowed before)
IN_PLACE = 2


def eligible(units: list[UnitSpec], index: int) -> bool:
    """A unit whose update can run on the card: it holds no tied copy of another unit's
    weights, and no other unit holds one of its own."""
    if units[index].aliases:
        return False
    return not any(e.alias_of[0] == index for u in units for e in u.aliases)


def unit_indices(spec: str, key: str, n_units: int) -> set[int] | None:
    """A unit list setting (`swap.card_update`, `swap.disk_acts`): the indices it names,
    set() for "none", None for "all". Raises ValueError naming the setting and the problem
    (not an index or range, a unit out of range)."""
    spec = spec.strip()
    if spec in ("", "none"):
        return set()
    if spec == "all":
        return None
    chosen: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(
                f"{key}: {part.strip()!r} is not a unit index or range "
                "(write none, all, or indices such as 1-4,7)"
            ) from None
        chosen.update(range(first, last + 1))
    bad = sorted(i for i in chosen if not 0 <= i < n_units)
    if bad:
        raise ValueError(
            f"{key}: unit {bad[0]} does not exist (this model has units 0-{n_units - 1})"
        )
    return chosen


def parse_units(spec: str, units: list[UnitSpec]) -> set[int]:
    """`swap.card_update` as unit indices: "none", "all" (every eligible unit), or a list
    such as "1-4,7". Raises ValueError naming the problem (a unit out of range, or one
    tied to another)."""
    chosen = unit_indices(spec, "swap.card_update", len(units))
    if chosen is None:
        return {i for i in range(len(units)) if eligible(units, i)}
    tied = sorted(i for i in chosen if not eligible(units, i))
    if tied:
        raise ValueError(
            f"swap.card_update: unit {tied[0]} shares tied weights with another unit, and "
            "its update stays on the host (leave it out, or write all)"
        )
    return chosen


def _padded(t: torch.Tensor, span: int) -> torch.Tensor:
    """`t` itself when it is `span` long, else a zero-padded copy of that length."""
    if t.numel() == span:
        return t
    out = torch.zeros(span, dtype=t.dtype, device=t.device)
    out[: t.numel()] = t
    return out


def _scatter(piece: torch.Tensor, offset: int, dests: list[torch.Tensor]) -> None:
    """Bytes [offset, offset + len(piece)) of a packed transfer into the byte views
    `dests`, laid back to back in the packing's order."""
    at = 0
    end = offset + piece.numel()
    for dst in dests:
        lo, hi = max(at, offset), min(at + dst.numel(), end)
        if lo < hi:
            dst[lo - at : hi - at].copy_(piece[lo - offset : hi - offset])
        at += dst.numel()


class CardGradients:
    """Card-updated units' gradients on the device, in fp32 and the unit's flat layout (as
    the host gradient would hold them): summed over a step's runs of visits (micro-batch-
    major), and, with exact clipping, kept in `pending` until the global norm is known.
    The ledger counts each from its first run to `release`."""

    def __init__(self, backend: Backend, ledger: MemoryLedger, units: list[UnitSpec]):
        self.backend, self.ledger, self.units = backend, ledger, units
        self._acc: dict[int, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}

    def add(
        self, u: int, p_grad: torch.Tensor | list[torch.Tensor], first: bool, last: bool
    ) -> torch.Tensor | None:
        """Sum one run's gradient (flat, or per parameter in unit order; the ledger held it
        until now); at the unit's last run of the step, return the sum."""
        unit = self.units[u]
        grads = [p_grad] if isinstance(p_grad, torch.Tensor) else p_grad
        acc = self._acc.pop(u, None)
        if acc is None and first and isinstance(p_grad, torch.Tensor):
            # a run's fp32 sum, already flat in the unit's layout with zero padding: it
            # becomes the sum itself (no second unit-sized fp32 buffer; the ledger counts it)
            assert p_grad.dtype == torch.float32 and p_grad.numel() == unit.n_total
            acc = p_grad
            grads = []
        self.ledger.sub(sum(g.nbytes for g in grads))
        if acc is None:  # zeros: the padding between parameters stays zero
            acc = torch.zeros(unit.n_total, dtype=torch.float32, device=self.backend.device)
            self.ledger.add(acc.nbytes)
        if isinstance(p_grad, torch.Tensor):
            views = [acc]  # already flat in the unit's layout (a run's accumulator)
        else:
            views = [acc[p.offset : p.offset + p.numel].view(p.shape) for p in unit.params]
        if grads and first:  # the host landing copies the first run, adds the others: so here
            torch._foreach_copy_(views, grads)
        elif grads:
            torch._foreach_add_(views, grads)
        if not last:
            self._acc[u] = acc
            return None
        return acc

    def release(self, acc: torch.Tensor) -> None:
        self.ledger.sub(acc.nbytes)

    def clear(self) -> None:
        """An abandoned step: drop every sum (the engine resets the ledger itself)."""
        self._acc.clear()
        self.pending.clear()


class CardUpdate:
    """Runs unit updates on the device over state kept in the host store and the unit
    optimizers (TorchUnitOptimizer for fp32 state, CompactAdamW for compact)."""

    def __init__(
        self,
        backend: Backend,
        store: HostStore,
        optimizers: list,
        worker: HostWorker,
        ledger: MemoryLedger,
        chunk: int = DEVICE_CHUNK,
    ):
        assert chunk % BLOCK == 0
        self.backend, self.store, self.optimizers = backend, store, optimizers
        self.worker, self.ledger = worker, ledger
        self.chunk_limit = chunk  # at most; fewer where the staging pool is small (_chunk)
        self.updates = 0
        self.bytes_up = self.bytes_down = 0  # state over the bus (benchmarks, tests)
        self.landed_in_place = 0  # chunks copied straight into the host state (tests)
        self._in_flight: list = []  # their transfers, the oldest first

    def run(
        self, u: int, grad: torch.Tensor, coef: float, lr: float, slot: torch.Tensor | None = None
    ) -> None:
        """Update unit `u` on the device from its summed fp32 gradient `grad` (flat, on the
        device, in the unit's layout), clipped by `coef`. `slot`: the unit's device copy,
        kept across steps: the new weights are written there too, and in compact state
        with a bf16 copy the master's upper half is read from it (no copy up). Returns
        once every copy and kernel is issued; the unit is `ready` again when its last
        piece has landed."""
        buf, tier = self.store.buffers[u], self.store.tier
        wtier = self.store.wtier if u in self.store.disk_weights else None
        buf.lock.acquire()
        buf.ready.clear()
        handed_over = paged = weights = False
        # kept on the card: the slot holds the weights (a peer's merge writes it there)
        from_slot = slot is not None

        def give_back() -> None:
            if paged:  # every piece has landed in the record: its write goes out now
                tier.release(u, dirty=True)
            if weights:  # the new compute copy too (a load sharing the slot waits for ready)
                wtier.release(u, dirty=True)
            buf.ready.set()
            buf.lock.release()

        try:
            if tier is not None:  # the NVMe tier: master and moments into a RAM slot
                tier.acquire(u)
                paged = True
            if wtier is not None:  # the compute copy on the weights tier: written whole
                wtier.acquire(u, fresh=True)
                weights = True
            chunk = self._chunk(buf)
            self.backend.keep_for_side(grad)
            # beside the backward's compute, not in its queue: the compute stream would
            # otherwise wait for each chunk's state to cross before the next unit's backward
            with self.backend.side_stream():
                if self.store.compact:
                    self._compact(u, grad, coef, lr, chunk, slot, from_slot)
                elif self.store.bf16:
                    self._bf16(u, grad, coef, lr, chunk, slot, from_slot)
                else:
                    self._fp32(u, grad, coef, lr, chunk, slot)
                if slot is not None:  # a read of the slot waits for this (card_kept.py)
                    self.store.card.updated(u, self.backend.record())
            handed_over = True
            self.worker.submit(lambda: None, cleanup=give_back)
        except BaseException:
            if not handed_over:
                # behind the landings already queued: they write into the record's slot,
                # which must not go to another unit first (a refused submit runs it now)
                try:
                    self.worker.submit(lambda: None, cleanup=give_back)
                except Exception:
                    pass  # the worker's own failure: raised by the next check
            raise
        self.updates += 1

    def _chunk(self, buf) -> int:
        """Elements per chunk: `chunk_limit`, or fewer where two chunks' packed state would
        not fit the D2H staging pool (a small model's pool is one small unit's gradient)."""
        # state bytes back per element (bf16 state: 4, counted as compact's 6)
        per = 12 if self.store.master_dtype == torch.float32 else 6
        if buf.master_on_card:
            per -= buf.compute.element_size()  # the master stays in the slot
        elif not (buf.compute_is_master or buf.kept):
            per += buf.compute.element_size()
        pool = self.backend.staging_bytes()
        fits = DEVICE_CHUNK if pool is None else pool // 2 // (per + 1)  # +1: block scales
        return min(self.chunk_limit, max(BLOCK, fits // BLOCK * BLOCK))

    # ------------------------------------------------------------------ state formats
    def _fp32(self, u: int, grad: torch.Tensor, coef: float, lr: float, chunk: int, slot) -> None:
        buf = self.store.buffers[u]
        step, groups = self.optimizers[u].begin_card_step()
        itemsize = buf.master.element_size()
        pieces = []
        for p, m, v, wd, betas in groups:
            base = (p.data_ptr() - buf.master.data_ptr()) // itemsize
            for start in range(0, p.numel(), chunk):
                end = min(p.numel(), start + chunk)
                pieces.append((base, start, end, p, m, v, wd, betas))

        def host_of(piece) -> list[torch.Tensor]:
            _, start, end, p, m, v, *_ = piece
            return [p[start:end], m[start:end], v[start:end]]

        def update(piece, dev: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            base, start, end, _, _, _, wd, betas = piece
            g = grad[base + start : base + end]
            if coef != 1.0:  # as the host update clips: the fp32 gradient times coef
                g = g * coef
            master, m, v = dev
            fp32_chunk(master, g, m, v, step, lr, betas, wd, end - start if wd else 0)
            if slot is not None:
                slot[base + start : base + end].copy_(master)
            return list(zip(dev, host_of(piece), strict=True)) + self._compute_copy(
                buf, master, base + start, base + end
            )

        self._stream(pieces, host_of, update)

    def _compact(
        self, u: int, grad: torch.Tensor, coef: float, lr: float, chunk: int, slot, from_slot: bool
    ) -> None:
        buf, opt = self.store.buffers[u], self.optimizers[u]
        cfg = opt.cfg
        opt.steps += 1
        betas = (cfg.beta1, cfg.beta2)
        scalars = compact_scalars(coef, lr, opt.steps, betas, cfg.weight_decay, grad.device)
        pieces = [(s, min(opt.n, s + chunk)) for s in range(0, opt.n, chunk)]
        # the master's upper half read from the unit's bf16 slot: it does not cross up (nor
        # back, where the slot is its only home)
        slot_master = from_slot and slot.dtype == torch.bfloat16
        master_back = [] if buf.master_on_card else [buf.master]

        def state_of(piece) -> list[torch.Tensor]:  # up and back: remainder, codes, scales
            start, end = piece
            span = padded(end - start)
            blocks = slice(start // BLOCK, (start + span) // BLOCK)
            return [
                buf.rem[start:end],
                opt.m_codes[start : start + span], opt.m_scales[blocks],
                opt.s_codes[start : start + span], opt.s_scales[blocks],
            ]  # fmt: skip

        def host_of(piece) -> list[torch.Tensor]:
            start, end = piece
            return ([] if slot_master else [buf.master[start:end]]) + state_of(piece)

        def update(piece, dev: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            start, end = piece
            n, span = end - start, padded(end - start)
            master = slot[start:end] if slot_master else dev[0]
            rem, *codes = dev[-5:]
            # whole blocks: a short last chunk pads with a zero gradient (its moments stay
            # zero); a whole one is updated where it lies (in the slot, for its master)
            g, w, r = (_padded(t, span) for t in (grad[start:end], master, rem))
            decayed = max(0, min(n, opt.n_decay - start))
            compact_chunk(g, w, r, *codes, scalars, betas, decayed if cfg.weight_decay else 0)
            if slot is not None and not (slot_master and n == span):
                slot[start:end].copy_(w[:n])
            # the slot itself (n == span) is rewritten by the next update: a copy of it
            # crosses back (a copy straight from it would have to be waited for there)
            back = w[:n].clone() if master_back and slot_master and n == span else w[:n]
            out = [back] * len(master_back) + [r[:n], *codes]
            host = [m[start:end] for m in master_back] + state_of(piece)
            return list(zip(out, host, strict=True)) + self._compute_copy(buf, w[:n], start, end)

        self._stream(pieces, host_of, update)

    def _bf16(
        self, u: int, grad: torch.Tensor, coef: float, lr: float, chunk: int, slot, from_slot: bool
    ) -> None:
        """bf16 state (atom/optim/bf16.py): the moments' codes and scales up and back, the
        bf16 weights up unless the unit's bf16 slot holds them, and back unless the slot is
        their only home (a unit kept on the card: `master_on_card`)."""
        buf, opt = self.store.buffers[u], self.optimizers[u]
        numbers, betas, key = opt.begin_step(lr)
        pieces = [(s, min(opt.n, s + chunk)) for s in range(0, opt.n, chunk)]
        slot_master = from_slot and slot.dtype == torch.bfloat16
        master_back = [] if buf.master_on_card else [buf.master]
        scratch = Bf16Scratch(min(chunk, opt.n), grad.device)  # one chunk's temporaries

        def host_of(piece) -> list[torch.Tensor]:
            start, end = piece
            return ([] if slot_master else [buf.master[start:end]]) + list(opt.codes(start, end))

        def update(piece, dev: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            start, end = piece
            w = slot[start:end] if slot_master else dev[0]
            codes = dev[-4:]
            decayed = max(0, min(end - start, opt.n_decay - start))
            bf16_chunk(grad[start:end], w, codes, coef, numbers, betas, decayed, key, start,
                       scratch)  # fmt: skip
            if slot is not None and not slot_master:
                slot[start:end].copy_(w)
            # the slot itself is rewritten by the next update: a copy of it crosses back (a
            # copy straight from it would have to be waited for there), as in _compact
            back = w.clone() if master_back and slot_master else w
            out = [back] * len(master_back) + list(codes)
            host = [m[start:end] for m in master_back] + list(opt.codes(start, end))
            return list(zip(out, host, strict=True)) + self._compute_copy(buf, w, start, end)

        self._stream(pieces, host_of, update)

    def _compute_copy(self, buf, weights: torch.Tensor, start: int, end: int) -> list:
        """The new weights into the unit's compute copy on the host, where that is a buffer
        of its own (a bf16 copy of an fp32 master, say): (device tensor, host view). None
        for a unit kept on the card: its slot is its compute copy."""
        if buf.compute_is_master or buf.kept:
            return []
        dst = buf.compute[start:end]
        return [(weights.to(dst.dtype), dst)]

    # ------------------------------------------------------------------ the stream
    def _stream(
        self,
        pieces: list,
        host_of: Callable[[object], list[torch.Tensor]],
        update: Callable[[object, list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> None:
        """Each piece's host tensors to the device, `update` on them there, and what it
        returns (device tensor, host destination) back, the next piece's copy in flight
        while this one updates."""
        if not pieces:
            return
        pending = self._issue_h2d(host_of(pieces[0]))
        for k, piece in enumerate(pieces):
            current = pending
            if k + 1 < len(pieces):
                pending = self._issue_h2d(host_of(pieces[k + 1]))
            dev, transfers = current
            for t in transfers:
                self.backend.wait_compute(t)
            self._land(update(piece, dev))
            self.ledger.sub(sum(d.nbytes for d in dev))

    def _issue_h2d(self, host: list[torch.Tensor]):
        after = self.backend.record()  # the device memory's earlier users are done first
        dev = [self.backend.alloc_device(h.numel(), h.dtype) for h in host]
        self.ledger.add(sum(d.nbytes for d in dev))
        self.bytes_up += sum(h.nbytes for h in host)
        return dev, [self.backend.h2d(d, h, after, []) for d, h in zip(dev, host, strict=True)]

    def _land(self, outs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each device tensor back into its host destination (a contiguous view of the
        unit's state). Where the backend page-locks the state (CUDA: every card unit's
        state, and the NVMe tier's slots, come from its pinned arena) straight into it
        (`_land_in_place`); else through the staging pool, landed on the host worker: one
        transfer for all of a chunk's tensors, packed as bytes on the device (a transfer
        takes whole staging chunks, and six small ones a chunk would hold six)."""
        if self.backend.pins_host and self._land_in_place(outs):
            return
        packed = torch.cat([src.reshape(-1).view(torch.uint8) for src, _ in outs])
        dests = [dst.view(torch.uint8) for _, dst in outs]
        self.bytes_down += packed.nbytes
        transfer = self.backend.d2h(packed, abort=self.worker.check)

        def land() -> None:
            for offset, host in self.backend.host_pieces(transfer):
                _scatter(host, offset, dests)
            self.backend.release_host(transfer)

        try:
            self.worker.submit(land, cleanup=lambda: self.backend.release_host(transfer))
        except BaseException:
            self.backend.release_host(transfer)
            raise

    def _land_in_place(self, outs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """The chunk's tensors copied by DMA straight into their page-locked destinations:
        no staging, no host copy after (the host memory sees each byte once, not three
        times). At most IN_PLACE chunks in flight, as the staging pool bounded them: the
        device memory of a chunk's state goes back only once its copies are done."""
        transfer = self.backend.d2h_into(outs)
        if transfer is None:
            return False
        self.bytes_down += sum(src.nbytes for src, _ in outs)
        self.landed_in_place += 1
        self._in_flight.append(transfer)
        if len(self._in_flight) > IN_PLACE:
            self.backend.wait_host(self._in_flight.pop(0))
        # the unit is given back (ready, lock) behind this: once the bytes are there
        self.worker.submit(lambda: self.backend.wait_host(transfer))
        return True
