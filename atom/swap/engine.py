"""SwapEngine: train a model whose parameters live on the host, streamed through the device.

One optimizer step is a list of unit visits known in advance (atom/swap/schedule.py):
unit-major (each unit runs every micro-batch while loaded) or micro-batch-major. So
prefetching is "keep the next prefetch+1 distinct units of the order on the device": after
a unit computes, its slot is released unless it is needed again within that window (the
last forward units stay for the first backward ones; `swap.resident_units` stay all step),
and the freed slot starts loading the next unit while the following one computes.

Backward of a unit: its parameters are reloaded; with `checkpoint` on the unit forward is
recomputed from the saved unit input, otherwise the autograd graph kept from the forward
is reused and saved_tensors_hooks re-point its saved parameters at whichever slot holds
the unit now. Each parameter is its own autograd leaf; a unit's gradients are summed on
the device over a run of consecutive visits and go D2H once per run to the host worker,
which lands them in the fp32 host gradient and runs the unit's optimizer step as soon as
they are final (or, when the global gradient norm is needed for clipping or fp16 overflow
checks, once all units have landed, in forward order so the next step's first units are
ready first; `swap.update: eager` clips by the previous step's norm instead and does not
wait).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from atom.config import Config
from atom.ground.engine_protocol import StepResult
from atom.ground.errors import ConfigError
from atom.ground.threads import host_worker_threads
from atom.model import build_model
from atom.model.compiled_blocks import compile_blocks, hidden_state, stand_in_params, wanted
from atom.model.documents import micro_batch
from atom.swap.activations import ActivationDisk
from atom.swap.backend import Backend
from atom.swap.card_kept import CardKept, stepping
from atom.swap.card_update import CardGradients, CardUpdate, parse_units
from atom.swap.disk_tier import DiskTier, UnitRecord
from atom.swap.engine_state import EngineState
from atom.swap.host_store import HostStore
from atom.swap.host_worker import HostWorker
from atom.swap.landing import GradientLanding, crossing_dtype
from atom.swap.loss_scaler import LossScaler
from atom.swap.schedule import GradRun, StepPlan, StepState
from atom.swap.slots import DeviceSlots, MemoryLedger
from atom.swap.unit_optimizers import unit_optimizers
from atom.swap.unit_passes import ON_DISK, UnitPasses
from atom.swap.units import UnitSpec, partition, run_unit
from atom.swap.update_timing import EAGER, EXACT, IMMEDIATE, EagerClip, resolve_timing
from atom.swap.weights import DiskWeights, disk_weight_units, weight_slots

log = logging.getLogger(__name__)


def _sq_norm(t: torch.Tensor) -> float:
    """Squared L2 norm, accumulated in fp32 whatever t's dtype."""
    if t.dtype == torch.float32:
        return float(torch.dot(t, t))
    return float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2


class SwapEngine(UnitPasses, EngineState):
    def __init__(
        self, cfg: Config, backend: Backend, compute_dtype: torch.dtype, init: bool = True
    ):
        self.cfg = cfg
        self.backend = backend
        self.dtype = compute_dtype
        self.model = build_model(cfg.model, device="meta")
        self.units: list[UnitSpec] = partition(self.model, cfg.swap.layers_per_unit)
        self.blocks_compiled = False
        if wanted(cfg.train.compile_blocks, backend.device):  # before the device fills up
            blocks = [part for u in self.units if u.kind == "blocks" for part in u.module.parts]
            example = hidden_state(cfg, backend.device, compute_dtype)
            bind = stand_in_params(backend.device, compute_dtype)
            self.blocks_compiled = compile_blocks(blocks, example, bind)
        try:
            self.card_units = parse_units(cfg.swap.card_update, self.units)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        # before any host memory: the widest of what crosses, gradients as computed or the
        # fp32 sums of several micro-batches (the card update's state crosses as bytes in
        # chunks sized to this pool)
        bf16_grad = cfg.swap.state != "fp32"  # compact and bf16 state: a bf16 host gradient
        crossing = [crossing_dtype(d, bf16_grad) for d in (compute_dtype, torch.float32)]
        backend.size_staging(
            max(u.n_total for u in self.units), max(crossing, key=lambda d: d.itemsize)
        )
        paged = cfg.swap.disk_dir is not None
        # units kept on the device for a whole step, each in a slot of its own: the block
        # units nearest the head; those updated on the card stay across steps too, their
        # weights living in the slot alone (card_kept.py), `persistent`
        n_res = cfg.swap.resident_units
        self.resident_units = set(range(len(self.units) - 1 - n_res, len(self.units) - 1))
        self.persistent = frozenset(self.resident_units & self.card_units)
        on_disk = disk_weight_units(
            cfg.swap.disk_weights, self.units, self.card_units, self.resident_units
        )
        self.store = HostStore(
            self.units, backend, compute_dtype, cfg.swap.state, paged, frozenset(self.card_units),
            on_disk, self.persistent,
        )  # fmt: skip
        # paged units' moments live in the tier's records, which the card update reads: no
        # page-locked moments of their own (unused, they would be most of the host RAM)
        self.optimizers = unit_optimizers(
            cfg, self.store, backend, set() if paged else self.card_units
        )
        self.tier: DiskTier | None = None
        if paged:
            records = [UnitRecord(opt.regions()) for opt in self.optimizers]
            # page-locked slots on CUDA: a card update's state copies are DMA from them
            alloc = backend.alloc_host_many if backend.pins_host else None
            self.tier = DiskTier(cfg.swap.disk_dir, records, cfg.swap.disk_slots, alloc)
            self.store.tier = self.tier
        self.wdisk: DiskWeights | None = None
        if on_disk:
            n_wslots = weight_slots(cfg.swap.prefetch)
            alloc = backend.alloc_host_many if backend.pins_host else None
            self.wdisk = DiskWeights(cfg.swap.disk_dir, on_disk, self.store, n_wslots, alloc)
        largest = max(u.n_total for u in self.units)
        own = {u: self.units[u].n_total for u in self.resident_units}
        self.slots = DeviceSlots(backend, cfg.swap.prefetch + 1, largest, compute_dtype, own)
        # before any weight is written: the card-kept units' slots are their weights' home
        self.store.card = CardKept(backend, self.slots, self.persistent)
        if init:
            self.store.init_weights(cfg.model, cfg.train.seed)
        self.ledger = MemoryLedger(self.slots.nbytes)
        self.scaler = LossScaler() if compute_dtype == torch.float16 else None
        self.timing = resolve_timing(cfg.swap.update, cfg.train.grad_clip, self.scaler is not None)
        self.eager_clip = EagerClip(cfg.train.grad_clip)
        self.worker = HostWorker(
            self._unblock_all, host_worker_threads(backend.device.type), inline=backend.inline
        )
        self.store.card.abort = self.worker.check  # a read waiting for a staging chunk
        self._norm_sq = [0.0] * len(self.units)
        self._lr = cfg.train.lr
        # from a step's first queued unit update to its end: it can no longer stop, and
        # Ctrl+C waits for its end (engine_protocol.Engine.committed)
        self.committed = False
        self._plans: dict[tuple, StepPlan] = {}
        self.landing = GradientLanding.of(backend, self.store)
        self.card = CardUpdate(backend, self.store, self.optimizers, self.worker, self.ledger)
        self.card_grads = CardGradients(backend, self.ledger, self.units)
        # card units whose tier record is asked for and not yet taken by their update, in
        # the order asked (an abandoned step gives them back in that order)
        self._card_reads: list[int] = []
        # offloaded unit inputs on the NVMe tier (swap.disk_acts): made at the first step,
        # when the hidden state's shape is known
        self.disk_inputs = self._disk_input_units()
        self.acts: ActivationDisk | None = None
        self.d2h_copies = self.d2h_bytes = 0  # gradient copies device -> host (benchmarks)
        self.norm_wait_s = 0.0  # end of step: waiting for the last gradients to land

    # ------------------------------------------------------------------ setup helpers
    @property
    def eager(self) -> bool:  # swap.update: eager, in effect
        return self.timing == EAGER

    @property
    def deferred(self) -> bool:  # updates wait for the step's global norm
        return self.timing == EXACT

    @property
    def skipped_units(self) -> int:  # eager: unit updates skipped for non-finite gradients
        return self.eager_clip.skipped_units

    def set_schedule(self, order: str | None = None, update: str | None = None) -> None:
        """Change swap.order / swap.update between steps (benchmarks compare them on one
        engine: building a multi-billion-parameter engine takes most of a minute)."""
        self.wait_idle()
        if order is not None:
            self.cfg.swap.order = order
            self._plans.clear()
        if update is not None:
            self.cfg.swap.update = update
            self.timing = resolve_timing(update, self.cfg.train.grad_clip, self.scaler is not None)
            self._norm_sq = [0.0] * len(self.units)

    def _unblock_all(self) -> None:
        for buf in self.store.buffers:
            buf.ready.set()

    def _join_side(self) -> None:
        """Before a step: the card updates' writes to the slots are done (the side stream).
        A host write into a card-kept unit's slot (a peer's merge, a checkpoint loaded) made
        the compute wait for it already (card_kept.py)."""
        self.backend.join_side()

    def _load(self, unit: int) -> None:
        """Start copying a unit to the device once its compute buffer is final: the unit and
        the owners of its aliases are updated (ready), and no one is writing them (locks)."""
        owners = sorted({unit} | {e.alias_of[0] for e in self.units[unit].aliases})
        bufs = [self.store.buffers[i] for i in owners]
        on_disk = self.wdisk is not None and unit in self.wdisk.units
        src = self.wdisk.source(unit) if on_disk else self.store.buffers[unit].compute
        slot = self.slots.load(unit, src, [b.ready for b in bufs], [b.lock for b in bufs])
        if on_disk:
            self.wdisk.loading(unit, slot.transfer)

    def _acquire(self, unit: int) -> torch.Tensor:
        """Compute waits for the unit's copy; a weights record it was copied from goes back."""
        flat = self.slots.acquire(unit)
        if self.wdisk is not None:
            self.wdisk.taken(unit)
        return flat

    def _begin_loads(self, plan: StepPlan) -> None:
        if self.wdisk is not None:
            self.wdisk.begin(plan, self.resident_units)

    # ------------------------------------------------------------------ schedule
    def _plan(self, n_micro: int) -> StepPlan:
        key = ("train", n_micro)
        if key not in self._plans:
            self._plans[key] = StepPlan.build(
                len(self.units), n_micro, self.cfg.swap.order, self.cfg.swap.prefetch + 1
            )
        return self._plans[key]

    def _advance(self, plan: StepPlan, pos: int, done_unit: int | None) -> None:
        """After position `pos`: free what is not needed soon, load what is."""
        window = plan.windows[pos + 1]
        leaving = done_unit is not None and done_unit not in window
        if leaving and done_unit not in self.resident_units:  # those stay until the step ends
            self.slots.release(done_unit)
        for unit in window:
            if not self.slots.has(unit):
                self._load(unit)

    # ------------------------------------------------------------------ one step
    @stepping
    def train_step(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        lr: float,
        stop: Callable[[], bool] | None = None,
    ) -> StepResult:
        """One optimizer step. `stop`, asked between unit visits, abandons the step (as
        KeyboardInterrupt, leaving the engine as before it) when it says so: a step of
        minutes still answers Ctrl+C within a visit. Only until the step's first update
        is queued (no clipping, or eager): after that it runs to its end, or a checkpoint
        of the previous step would hold some units of this one."""
        self.worker.check()
        self.committed = False
        self._lr = lr
        n_micro = len(batches)
        N = len(self.units)
        plan = self._plan(n_micro)
        self._inputs_for_step(plan, n_micro)
        scale = (self.scaler.scale if self.scaler else 1.0) / n_micro
        if self.timing != EAGER:  # eager: the worker resets it when it closes a step
            self._norm_sq = [0.0] * N
        st = StepState(torch.zeros((), device=self.backend.device, dtype=torch.float32))
        ledger_at_start = self.ledger.current
        self._join_side()
        self._begin_loads(plan)
        try:
            self._advance(plan, -1, None)
            for pos, v in enumerate(plan.visits):
                if stop is not None and not self.committed and stop():
                    raise KeyboardInterrupt
                m, u = v.micro, v.unit
                if v.phase == "f" and u == 0:
                    batch = micro_batch(batches[m], self.backend.device)
                    st.h[m], st.targets[m], st.docs[m] = batch
                if not self.slots.has(u):
                    self._load(u)
                self._read_ahead(u, plan.runs.get(pos))
                flat = self._acquire(u)
                if v.phase == "f" and u < N - 1:
                    st.h[m] = self._forward_unit(u, m, flat, st.h[m], st.saved, st.docs[m])
                elif v.phase == "f":  # head: forward with grad and its backward right away
                    loss, st.grad_h[m], grads = self._head_step(
                        u, flat, st.h.pop(m), st.targets.pop(m), scale, st.docs[m]
                    )
                    st.loss_sum += loss.detach()
                    self._accumulate(u, grads, plan.runs[pos], st)
                else:
                    docs = st.docs.pop(m) if u == 0 else st.docs[m]  # its masks go with it
                    st.grad_h[m], grads = self._backward_unit(
                        u, m, flat, st.grad_h.pop(m), st.saved, docs
                    )
                    self._accumulate(u, grads, plan.runs[pos], st)
                self._advance(plan, pos, u)
            self.slots.release_all(keep=self.persistent)
        except BaseException:
            self._abandon_step(ledger_at_start, st)
            self.committed = False
            raise
        try:
            return self._finish_step(st.loss_sum, n_micro)
        except BaseException:
            # an update cut short (inline, by a Ctrl+C not held off) never releases its
            # unit: a later load or checkpoint would wait for it
            self._unblock_all()
            raise
        finally:
            self.committed = False

    def _abandon_step(self, ledger_at_start: int, st: StepState) -> None:
        """A step that raised (a bad batch, an OOM, Ctrl+C inside it) leaves nothing
        half-done: slots are freed, the device finishes what was issued (an offload copy
        may still be writing a host buffer), offloaded inputs go back to their pool, the
        host worker finishes what it was given, tier records read ahead for card updates
        that will not come go back unwritten, and units whose update was deferred to
        the end of the step are unblocked without one (their partial gradients are
        overwritten by the next step's first micro-batch). Without this, the next load or
        checkpoint would wait for updates never submitted. A second Ctrl+C in here (the
        waits can be long) does not cut the cleaning short: it goes up once it is done."""
        interrupt: KeyboardInterrupt | None = None

        def attempt(step, what: str) -> None:
            nonlocal interrupt
            try:
                step()
            except KeyboardInterrupt as err:
                interrupt = interrupt or err
            except Exception:  # the error that ended the step may be this one's own
                log.exception("%s failed while abandoning a step", what)

        # the card-kept units' slots stay: their weights live nowhere else
        attempt(lambda: self.slots.release_all(keep=self.persistent), "freeing the device slots")
        attempt(self.backend.synchronize, "device synchronize")
        for (u, _), x in st.saved.items():
            if self._offloaded(u) and x is not ON_DISK:
                self.backend.reclaim(x)
        st.saved.clear()
        if self.acts is not None:
            attempt(self.acts.discard, "the unit inputs on the disk")
        self.card_grads.clear()
        self.ledger.current = ledger_at_start
        attempt(self.worker.drain, "the host worker")
        reads, self._card_reads = self._card_reads, []
        for u in reads:  # read ahead for updates that will not come: in the order asked
            attempt(lambda u=u: self.tier.discard(u), "giving back a tier record")
        if self.wdisk is not None:  # loads' records (their copies are done), reads ahead
            attempt(self.wdisk.abandon, "giving back weight records")
        # units whose update was deferred get none: unblocked after what the worker still
        # holds (all of it, unless a Ctrl+C cut the drain short); a failed worker runs the
        # cleanup at once
        attempt(lambda: self.worker.submit(lambda: None, cleanup=self._unblock_all), "unblock")
        if interrupt is not None:
            raise interrupt

    # ------------------------------------------------------------------ gradients
    def _accumulate(self, u: int, grads: list[torch.Tensor], run: GradRun, st) -> None:
        """Add one visit's parameter gradients into the unit's flat device accumulator;
        at the end of a run of visits, send it to the host (one copy per run). A run of one
        visit sends the gradients as they are (no accumulator, no extra device copy)."""
        if run.length == 1:
            self._post_grads(u, grads, first=run.first_run, last=run.last_run)
            return
        unit = self.units[u]
        if run.first_visit:
            # fp32: several micro-batches add up here (the compute dtype would lose bits)
            acc = torch.zeros(unit.n_total, dtype=torch.float32, device=self.backend.device)
            self.ledger.add(acc.nbytes)
            st.acc[u] = (acc, [acc[p.offset : p.offset + p.numel].view(p.shape)
                               for p in unit.params])  # fmt: skip
            torch._foreach_copy_(st.acc[u][1], grads)
        else:
            torch._foreach_add_(st.acc[u][1], grads)
        self.ledger.sub(sum(g.nbytes for g in grads))
        if run.last_visit:
            acc, _ = st.acc.pop(u)
            self._post_grads(u, acc, first=run.first_run, last=run.last_run)

    # ------------------------------------------------------------------ host side
    def _post_grads(
        self, u: int, p_grad: torch.Tensor | list[torch.Tensor], first: bool, last: bool
    ) -> None:
        """Send a unit's gradient (flat, or per parameter in unit order) to the host worker,
        which copies or adds it into the unit's fp32 host gradient. A unit updated on the
        card keeps its gradient on the device instead (`_card_grads`)."""
        if u in self.card_units:
            self._card_grads(u, p_grad, first, last)
            return
        buf = self.store.buffers[u]
        grads = [p_grad] if isinstance(p_grad, torch.Tensor) else p_grad
        self.ledger.sub(sum(g.nbytes for g in grads))
        cross = crossing_dtype(grads[0].dtype, self.store.master_dtype == torch.bfloat16)
        self.d2h_copies += 1
        self.d2h_bytes += sum(g.numel() for g in grads) * cross.itemsize
        inv_scale = 1.0 / self.scaler.scale if self.scaler else 1.0
        lr = self._lr  # captured: the worker may run this after the next step has begun
        if last:
            buf.ready.clear()  # the next copy of this unit must wait for its update
            if self.timing != EXACT:
                self.committed = True  # the landing below updates the unit
                if self.tier is not None:
                    self.tier.prefetch(u)  # its update follows the landing on the worker

        def land() -> None:
            self.landing.land(u, transfer, first)
            if not last:
                return
            # Aliases of this unit were computed by later units, whose grads landed earlier.
            self.store.fold_alias_grads(u)
            if inv_scale != 1.0:
                buf.grad.mul_(inv_scale)
            if self.timing != IMMEDIATE:  # exact and eager need the step's global norm
                self._norm_sq[u] = _sq_norm(buf.grad[: buf.spec.n_owned])
            if self.timing == EAGER:
                if math.isfinite(self._norm_sq[u]):
                    self._update(u, self.eager_clip.coef, lr)
                else:  # never apply a non-finite gradient; the rest of the step goes on
                    self.eager_clip.skipped_units += 1
                    log.warning("non-finite gradient in unit %d: its update is skipped", u)
                    with self.store.paged_in(u, dirty=False):
                        pass  # the prefetched state goes back unchanged
                    buf.ready.set()
            elif self.timing == IMMEDIATE:
                self._update(u, 1.0, lr)

        # abort: if the worker failed, the staging chunks it held are coming back, and
        # its error is what the training thread should raise, at once
        transfer = self.backend.d2h(p_grad, abort=self.worker.check, dtype=cross)
        # the staging chunks go back in every case: landed, failed, skipped after an
        # earlier job failed, or never queued (release_host is idempotent; land hands
        # them back as it goes): a lost chunk would, some steps on, be a hang
        try:
            self.worker.submit(land, cleanup=lambda: self.backend.release_host(transfer))
        except BaseException:
            self.backend.release_host(transfer)
            raise

    def _card_grads(
        self, u: int, p_grad: torch.Tensor | list[torch.Tensor], first: bool, last: bool
    ) -> None:
        """A card-updated unit's gradient: summed in fp32 on the device in the unit's flat
        layout (as the host gradient would hold it), then updated there as the timing says:
        at once (no clipping), clipped by the previous step's norm (eager), or kept until
        the step's norm is known (exact: `_finish_step`)."""
        acc = self.card_grads.add(u, p_grad, first, last)
        if acc is None:  # more runs of this unit to come this step (micro-batch-major)
            return
        if self.scaler:
            acc.mul_(1.0 / self.scaler.scale)
        if self.timing != IMMEDIATE:
            self._norm_sq[u] = _sq_norm(acc[: self.units[u].n_owned])
        if self.timing == EXACT:
            self.card_grads.pending[u] = acc  # on the device until the norm is known
            return
        self.committed = True  # the update below changes the unit
        if self.timing == EAGER and not math.isfinite(self._norm_sq[u]):
            self.eager_clip.skipped_units += 1
            log.warning("non-finite gradient in unit %d: its update is skipped", u)
            if u in self._card_reads:  # its record goes back unwritten
                self._card_reads.remove(u)
                self.tier.discard(u)
        else:
            self._card_update(u, acc, self.eager_clip.coef if self.timing == EAGER else 1.0)
        self.card_grads.release(acc)

    def _read_ahead(self, u: int, run: GradRun | None) -> None:
        """The NVMe tier: a card unit's record is read while its last run of visits computes,
        so that its update, at the run's end, finds it in RAM. Reads are served in the order
        asked, so they are asked in the order updates take them: host units' at their last
        landing, card units' here. Not for exact updates: they wait for the step's end, in
        forward order, and a slot held per card unit until then would leave none for
        the reads they wait behind once card units outnumber swap.disk_slots."""
        if self.tier is None or u not in self.card_units or self.timing == EXACT:
            return
        if run is not None and run.first_visit and run.last_run:
            self.tier.prefetch(u)
            self._card_reads.append(u)

    def _card_update(self, u: int, grad: torch.Tensor, coef: float) -> None:
        if u in self._card_reads:
            self._card_reads.remove(u)  # taken by the update below
        self.card.run(u, grad, coef, self._lr, self._slot_of(u))

    def _slot_of(self, u: int) -> torch.Tensor | None:
        """A unit's device copy, kept across steps, that its card update writes into."""
        return self.slots.flat_of(u) if u in self.persistent else None

    def _update(self, u: int, coef: float, lr: float) -> None:
        buf = self.store.buffers[u]
        with self.store.paged_in(u), buf.lock:
            self.optimizers[u].step(lr, coef)
            self.store.refresh_compute(u)
        buf.ready.set()

    def _finish_step(self, loss_sum: torch.Tensor, n_micro: int) -> StepResult:
        loss = float(loss_sum) / n_micro
        if self.timing == EAGER:
            norm = self.eager_clip.norm  # the previous step's (inline, the next line sets it)
            # Runs on the worker after this step's gradients have all landed and before any
            # of the next step's (FIFO): the next step's updates clip by this step's norm.
            self.worker.submit(self._close_eager_step)
            return StepResult(loss=loss, grad_norm=norm)
        if self.timing == IMMEDIATE:
            return StepResult(loss=loss, grad_norm=None)
        t0 = time.perf_counter()
        self.worker.drain()
        self.norm_wait_s += time.perf_counter() - t0
        total = math.sqrt(sum(self._norm_sq))
        overflow = not math.isfinite(total)
        if self.scaler is not None:
            self.scaler.update(overflow)
        pending, self.card_grads.pending = self.card_grads.pending, {}
        if overflow:
            log.warning("non-finite gradient norm: step skipped")
            self._unblock_all()
            for grad in pending.values():
                self.card_grads.release(grad)
            return StepResult(loss=loss, grad_norm=total, skipped=True)
        clip = self.cfg.train.grad_clip
        coef = min(1.0, clip / (total + 1e-6)) if clip > 0 else 1.0
        self.committed = True  # inline (CPU), the updates below run now
        for u in range(len(self.units)):  # forward order: the next step needs unit 0 first
            if u in pending:
                grad = pending.pop(u)
                self._card_update(u, grad, coef)
                self.card_grads.release(grad)
                continue
            if self.tier is not None:
                self.tier.prefetch(u)  # reads run ahead of the worker, in its order
            self.worker.submit(lambda u=u, lr=self._lr: self._update(u, coef, lr))
        return StepResult(loss=loss, grad_norm=total)

    def _close_eager_step(self) -> None:
        self.eager_clip.close_step(self._norm_sq)
        self._norm_sq = [0.0] * len(self.units)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    @stepping
    def evaluate(self, batches: list[tuple], weights: list[float] | None = None) -> float:
        """Mean loss over batches (weighted: by each one's learned tokens, say), unit-major:
        each unit is loaded once for all of them."""
        weights = weights or [1.0] * len(batches)
        N = len(self.units)
        key = ("eval", len(batches))
        if key not in self._plans:
            self._plans[key] = StepPlan.evaluation(N, len(batches), self.cfg.swap.prefetch + 1)
        plan = self._plans[key]
        total = torch.zeros((), device=self.backend.device)
        h, targets, docs = {}, {}, {}  # micro -> hidden state, targets, Documents or None
        self._join_side()
        self._begin_loads(plan)
        try:
            self._advance(plan, -1, None)
            for pos, v in enumerate(plan.visits):
                b, u = v.micro, v.unit
                if u == 0:
                    h[b], targets[b], docs[b] = micro_batch(batches[b], self.backend.device)
                if not self.slots.has(u):
                    self._load(u)
                flat = self._acquire(u)
                if u < N - 1:
                    h[b] = run_unit(self.units[u], flat, h[b], docs=docs[b])
                else:
                    loss = run_unit(self.units[u], flat, h.pop(b), targets.pop(b), docs.pop(b))
                    total += loss.float() * weights[b]
                self._advance(plan, pos, u)
        finally:
            self.slots.release_all(keep=self.persistent)
            if self.wdisk is not None:
                self.wdisk.abandon()  # nothing, after a whole pass
        return float(total) / sum(weights)

    def close(self) -> None:
        """Finish the host work, then release the device slots and the pinned memory at
        once (no reference cycle leaves them to a garbage collection)."""
        try:
            self.worker.drain(timeout=60)
        finally:
            self.worker.close()
            try:
                self.backend.synchronize()  # no copy may be using a slot that goes
            finally:
                try:
                    self.slots.close()
                    self.backend.close()
                finally:
                    if self.tier is not None:
                        self.tier.close()
                    if self.wdisk is not None:
                        self.wdisk.tier.close()
                    if self.acts is not None:
                        self.acts.close()
