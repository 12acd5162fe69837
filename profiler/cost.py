"""Memory and time models of one swapped training step for a candidate plan.

Peak device bytes (what the engine's ledger counts, plus CUDA-only workspace):
    slots: (prefetch + 1) shared ones of the largest unit's size, and one sized to each
    resident unit (swap.resident_units, the block units nearest the head)
  + checkpointed unit inputs (N - 2 of them, unless offloaded to host)
  + the larger of: one unit's working activations during its recompute + backward, or
    the head's (whose fp32 log-softmax over the vocabulary is often the biggest buffer)
  + one unit's parameter gradient on its way to the host
  + units updated on the card (swap.card_update): the fp32 gradient sum of the unit being
    updated (of every such unit, where they wait for the step's global norm or sum over
    micro-batch-major passes) and two chunks of its optimizer state
  + on CUDA: the head backward's transients (logits and their fp32 gradients) and
    allocator slack.
Without checkpointing every block's activations are kept through the forward instead.

Step time: the unit pipeline per micro-batch, each stage max(compute, transfer) at the
chosen prefetch depth, times grad_accum, plus the host optimizer tail. A unit updated on
the card sends no gradient to the host: its optimizer state crosses the bus instead (in
with the backward's weight reloads, out with the other units' gradients), and its update
runs on the card, either in the backward as its gradient is final (no clipping, or
swap.update eager) or, with exact clipping, after the backward one unit after another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from atom.config import SwapConfig
from atom.profiler import state_formats
from atom.profiler.analysis import ModelAnalysis, UnitInfo, dtype_bytes
from atom.profiler.hardware import HardwareSpec
from atom.profiler.state_formats import (
    CARD_DOWN_DRAM_PASSES,
    card_state_bytes,
    card_work_s,
    host_update_s_per_param,
    master_dtype,
    pinned_state_per_param,
    update_dram_bytes,
)
from atom.profiler.timing import PieceTimes
from atom.swap.card_update import DEVICE_CHUNK
from atom.swap.pinned import ALIGN

__all__ = ["card_state_bytes", "card_work_s"]  # the state's bytes, re-exported (tests)
# the NVMe tier's RAM slots: DiskTier keeps max(2, swap.disk_slots) records in RAM
TIER_SLOTS = max(2, SwapConfig().disk_slots)


@dataclass(frozen=True)
class Candidate:
    """One plan the profiler weighs: a partition, a batch, a host state and where each unit
    lives. Fields that are swap settings carry SwapConfig's names (swap_settings()), so
    nothing translates."""

    layers_per_unit: int
    prefetch: int
    micro_batch: int
    grad_accum: int
    checkpoint: bool
    offload_activations: bool
    order: str = "unit"  # swap.order: unit-major or micro-batch-major (same when accum 1)
    resident_units: int = 0  # block units nearest the head kept on the device (own slots)
    # fp32; compact (bf16 + remainder + 8-bit moments, half the RAM); bf16 (no fp32 master:
    # lighter, not bit-exact; only when asked)
    state: str = "fp32"
    disk_tier: bool = False  # master and moments on disk (swap.disk_dir), paged around updates
    card_update: str = "none"  # swap.card_update: units whose update runs on the device
    update: str = "exact"  # swap.update: with clipping, wait for the norm, or eager
    # with offload_activations: unit inputs (those nearest the head) kept on the device
    # all the same; the rest offloaded. Not a swap setting: the engine offloads all or none
    acts_on_card: int = 0
    # the tiered plan (profiler/tiers.py): weights, optimizer state and offloaded unit
    # inputs placed across RAM and the NVMe disk, every update on the card, no host
    # gradient. The plan says what of it the engine lacks (tiers.needs)
    tiered: bool = False
    # the tiered plan's units (swap.card_update's syntax) whose compute copy, optimizer
    # state and offloaded inputs are on the NVMe disk
    disk_weights: str = "none"
    disk_state: str = "none"
    disk_acts: str = "none"

    def swap_settings(self) -> dict:
        """The swap section this candidate means (disk_tier aside: the directory is the
        user's, swap.disk_dir)."""
        names = {f.name for f in fields(SwapConfig)}
        return {k: v for k, v in asdict(self).items() if k in names}


def card_units(a: ModelAnalysis, c: Candidate) -> frozenset[int]:
    """The units `c.card_update` names (as atom/swap/card_update.py parses it): "none",
    "all" (every unit not tied to another) or indices such as "1-32,34"."""
    spec = c.card_update.strip()
    if spec in ("", "none"):
        return frozenset()
    if spec == "all":
        return frozenset(u.index for u in a.units if not u.tied)
    chosen: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        chosen.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(chosen)


def format_units(units: set[int] | frozenset[int]) -> str:
    """Unit indices as swap.card_update writes them: "none", or ranges such as "1-32,34"."""
    if not units:
        return "none"
    runs: list[list[int]] = []
    for i in sorted(units):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def card_pinned_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype) -> int:
    """Host state the engine page-locks for units updated on the card (HostStore and
    swap/unit_optimizers.py): the moments, the remainder, and the master where it is not
    the compute copy. None on the NVMe tier: that state lives in the tier's records, and
    crosses from its slots (tier_pinned_bytes)."""
    if c.disk_tier:
        return 0
    per = pinned_state_per_param(c.state, dtype)
    return int(sum(a.units[u].n_owned * per for u in card_units(a, c)))


def tier_pinned_bytes(a: ModelAnalysis, c: Candidate) -> int:
    """The NVMe tier's RAM slots, page-locked on CUDA (swap/disk_tier.py: each asked a page
    longer, to cut it at a page boundary)."""
    if not c.disk_tier:
        return 0
    return TIER_SLOTS * (max(a.record_bytes(c.state)) + ALIGN)


def resident_set(a: ModelAnalysis, c: Candidate) -> frozenset[int]:
    """swap.resident_units as indices: the block units nearest the head."""
    n = len(a.units)
    return frozenset(range(n - 1 - c.resident_units, n - 1))


def kept_units(a: ModelAnalysis, c: Candidate, dtype: torch.dtype) -> frozenset[int]:
    """Units kept on the card across steps and updated there: the engine keeps no host
    compute copy of them (their slot is the copy; atom/swap/host_store.py), nor, where the
    state's bf16 master is that copy itself (not paged to the NVMe tier), the master."""
    if not state_formats.ENGINE_CARD_WEIGHTS_STAY:
        return frozenset()
    return resident_set(a, c) & card_units(a, c)


def update_timing(c: Candidate, grad_clip: float, dtype: torch.dtype) -> str:
    """When updates run, as the engine resolves it (atom/swap/update_timing.py): immediate
    without clipping, eager with swap.update eager, else exact (fp16 loss scaling needs
    the step's norm: always exact)."""
    scaling = dtype == torch.float16
    if grad_clip <= 0 and not scaling:
        return "immediate"
    return "eager" if c.update == "eager" and not scaling else "exact"


def _chunk_bytes(u: UnitInfo, state: str, dtype: torch.dtype, cuda: bool) -> int:
    """Device bytes of a card update's state chunks (two in flight: double-buffered), and
    on CUDA one chunk's temporaries (the fp32 gradient slice, padded weights/remainder,
    fp32 moments)."""
    n = min(u.n_total, 2 * DEVICE_CHUNK)
    up, _ = card_state_bytes(u, state, dtype, False)
    work = min(u.n_total, DEVICE_CHUNK) * (6 if state == "fp32" else 16) if cuda else 0
    return int(up / u.n_total * n) + work


@dataclass
class Prediction:
    step_s: float
    tokens_per_s: float
    peak_device_bytes: int
    host_bytes: int
    bottleneck: str  # compute | bus | host
    detail: dict

    def to_dict(self) -> dict:
        return asdict(self)


def peak_device_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype, cuda: bool) -> int:
    dt = dtype_bytes(dtype)
    n_units = len(a.units)
    resident = resident_set(a, c)
    slots = ((c.prefetch + 1) * a.largest_unit + sum(a.units[i].n_total for i in resident)) * dt
    hidden = a.hidden_bytes(c.micro_batch, dtype)
    block = a.block_activation_bytes(c.micro_batch, dtype)
    head = a.head_activation_bytes(c.micro_batch, dtype)
    lpu = a.most_blocks
    largest_block_unit = a.largest_block_unit * dt
    head_unit = a.units[-1].n_total * dt
    tokens = c.micro_batch * a.cfg.model.seq_len
    # unit-major with several micro-batches: every micro-batch's boundary state is kept at
    # once, the other micro-batches' hidden (or its gradient) waits at the frontier, and
    # a unit's gradient is summed over micro-batches in an fp32 accumulator
    m = c.grad_accum if c.order == "unit" else 1
    frontier = (m - 1) * hidden
    accumulator = a.largest_unit * 4 if m > 1 else 0
    card = _card_bytes(a, c, dtype, cuda, m)
    if c.checkpoint:
        kept = (c.acts_on_card if c.offload_activations else n_units - 2) * hidden * m
        # recompute of a unit: all its blocks' saved tensors, and the inputs of all but the
        # first (that one is the checkpoint, already counted, unless it was offloaded)
        inner_inputs = lpu if c.offload_activations else lpu - 1
        working = max(
            max(head + head_unit, card.head),
            max(lpu * block + inner_inputs * hidden + largest_block_unit, card.block) + card.held,
        )
        peak = slots + kept + working + frontier + accumulator
    else:
        n_layer = a.cfg.model.n_layer
        embed_saved = tokens * 8 + a.cfg.model.seq_len * 8  # token ids, positions (int64)
        # everything saved stays until the backward frees it; the peak comes at the head
        # (its activations + gradient) or at the first block unit's gradient
        peak = (
            slots
            + m * (embed_saved + n_layer * (block + hidden))
            + max(head + head_unit, card.head, largest_block_unit + card.held, card.block)
            + frontier
            + accumulator
        )
    # the embedding's update on the card, last in the backward (or every card unit's update
    # after it, with exact clipping)
    peak = max(peak, slots + card.end)
    if cuda:
        peak += a.head_workspace_bytes(c.micro_batch, dtype) + 2 * hidden
        peak = int(peak * 1.05)  # caching-allocator rounding and fragmentation
    return int(peak)


def card_held_all_step(c: Candidate, grad_clip: float, dtype: torch.dtype) -> bool:
    """Do card units' fp32 gradients wait on the device for the step's end? With exact
    clipping (until the norm is known), and micro-batch-major with several micro-batches
    (summed over the passes)."""
    micro_major = c.order == "micro" and c.grad_accum > 1
    return micro_major or update_timing(c, grad_clip, dtype) == "exact"


@dataclass
class _CardBytes:
    head: int = 0  # as the head's update runs (its activations are gone by then)
    block: int = 0  # as a block unit's update runs, its recompute's activations gone
    held: int = 0  # sums held while later units run their backward (exact, micro-major)
    end: int = 0  # after the backward: the embedding's update, or every sum and an update


def _card_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype, cuda: bool, m: int):
    """Device bytes of the update on the card: each card unit's fp32 gradient sum (n_total
    x 4) from its backward to its update, and two chunks of its state while it updates.
    The engine's ledger (the CPU figure) gives back the gradient as it is summed in (the
    compute-dtype gradient, or unit-major's fp32 micro-batch sum); on CUDA both exist at
    that moment."""
    card = card_units(a, c)
    if not card:
        return _CardBytes()
    dt = dtype_bytes(dtype)

    def updating(u: UnitInfo) -> int:
        chunks = _chunk_bytes(u, c.state, dtype, cuda)
        if m > 1:  # the micro-batch sum (counted as `accumulator`) is copied into this one
            return (4 * u.n_total if cuda else 0) + chunks
        return (
            max(u.n_total * dt + 4 * u.n_total, 4 * u.n_total + chunks)
            if cuda
            else (4 * u.n_total + chunks)
        )

    units = [a.units[i] for i in sorted(card)]
    head, embed = a.units[-1], a.units[0]
    blocks = [u for u in units if u.kind == "blocks"]
    # (the bytes grow with a unit's size: the largest card block unit's are the most)
    widest = max(blocks, key=lambda u: u.n_total, default=None)
    out = _CardBytes(
        head=updating(head) if head.index in card else 0,
        block=updating(widest) if widest else 0,
        end=updating(embed) + embed.n_total * dt if embed.index in card else 0,
    )
    if card_held_all_step(c, a.cfg.train.grad_clip, dtype):
        # every card unit's sum stays until the step's end: while the blocks run their
        # backward, those of the head and the later blocks; then all of them, and an update
        out.block = 0
        out.held = sum(4 * u.n_total for u in units if u.index != 0)
        chunks = _chunk_bytes(max(units, key=lambda u: u.n_total), c.state, dtype, cuda)
        out.end = sum(4 * u.n_total for u in units) + chunks + embed.n_total * dt
    return out


def host_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype, cuda: bool) -> int:
    card, kept = card_units(a, c), kept_units(a, c, dtype)
    total = a.host_bytes(dtype, c.state, c.disk_tier, card=card, kept=kept)
    if cuda:
        total += staging_bytes(a, c, dtype)
        total += TIER_SLOTS * ALIGN if c.disk_tier else 0  # the slots' alignment
    if c.offload_activations:
        total += offloaded_bytes(a, c, dtype)
    return total


def staging_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype) -> int:
    """The pinned D2H staging pool (CUDA): one unit's gradient in the widest dtype that
    crosses (the compute dtype; fp32 sums of several micro-batches, which compact state
    rounds to bf16 as they cross; fp32 state of a unit updated on the card)."""
    card = c.card_update.strip() not in ("", "none")
    item = dtype_bytes(dtype) if c.state != "fp32" and not card else 4
    return a.largest_unit * item


def offloaded_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype) -> int:
    """Host bytes of the checkpointed unit inputs kept in host memory at once: every unit
    but the first and the head (and those kept on the card, acts_on_card), for each
    micro-batch in flight (all of them, unit-major)."""
    m = c.grad_accum if c.order == "unit" else 1
    return offloaded_units(a, c) * a.hidden_bytes(c.micro_batch, dtype) * m


def offloaded_units(a: ModelAnalysis, c: Candidate) -> int:
    """Unit inputs offloaded: every unit's but the first's and the head's, less those kept
    on the card."""
    return max(0, len(a.units) - 2 - c.acts_on_card) if c.offload_activations else 0


def _pipeline(compute: list[float], transfer: list[float], prefetch: int) -> tuple[float, float]:
    """Time to run stages whose unit copies overlap earlier stages' compute.

    prefetch 0: copy then compute, serially. prefetch 1: each copy overlaps the previous
    unit's compute only. Deeper: copies run ahead and absorb variation, so the slower of
    total compute and total transfer wins. Returns (time, time the bus was the limit)."""
    if not compute:
        return 0.0, 0.0
    if prefetch == 0:
        return sum(compute) + sum(transfer), sum(transfer)
    first, rest = transfer[0], transfer[1:] + [0.0]
    if prefetch == 1:
        stages = [max(c, t) for c, t in zip(compute, rest, strict=True)]
        bus = sum(max(0.0, t - c) for c, t in zip(compute, rest, strict=True))
        return first + sum(stages), first + bus
    total = max(sum(compute), sum(rest))
    return first + total, first + max(0.0, sum(rest) - sum(compute))


def predict(
    a: ModelAnalysis,
    c: Candidate,
    hw: HardwareSpec,
    times: PieceTimes,
    dtype: torch.dtype,
) -> Prediction:
    """Step time of one plan. Unit-major (`c.order == "unit"`) runs the unit pipeline once
    per step with every stage's compute multiplied by grad_accum (each unit crosses the bus
    once per pass); micro-batch-major runs it grad_accum times. When updates run
    (`update_timing`): eager or without clipping, a unit updates while the backward of
    earlier units still runs; exact, after the step's last gradient."""
    cuda = hw.device == "cuda"
    dt = dtype_bytes(dtype)
    units = a.units
    m_total = c.grad_accum
    unit_major = c.order == "unit" or m_total == 1
    per_pass = m_total if unit_major else 1  # micro-batches per unit visit run
    passes = 1 if unit_major else m_total  # times the unit pipeline runs per step
    body = units[:-1]  # embed + block units; the head runs forward and backward at once
    resident = resident_set(a, c)
    card = card_units(a, c)
    # resident units updated on the card stay on the device across steps: never copied
    persistent = resident & card
    timing = update_timing(c, a.cfg.train.grad_clip, dtype)
    h2d = [u.n_total * dt / hw.h2d_bps for u in units]
    fwd_c = [times.embed / 3 if u.kind == "embed" else u.n_blocks * times.block_fwd for u in body]
    fwd_c_all = [t * per_pass for t in fwd_c + [times.head]]
    # resident units (the block units before the head) are loaded by the first forward
    # only (those kept across steps not even then): later passes and every backward find
    # them on the device
    h2d_first = [0.0 if u.index in persistent else h2d[u.index] for u in units]
    h2d_later = [0.0 if u.index in resident else h2d[u.index] for u in units]
    fwd, fwd_bus = _pipeline(fwd_c_all, h2d_first, c.prefetch)
    fwd_later, fwd_later_bus = _pipeline(fwd_c_all, h2d_later, c.prefetch)
    # backward over body units in reverse; the last `prefetch` of the forward stay resident
    recompute = times.block_fwd if c.checkpoint else 0.0
    bwd_c = [
        per_pass
        * (times.embed * 2 / 3 if u.kind == "embed" else u.n_blocks * (recompute + times.block_bwd))
        for u in reversed(body)
    ]
    dup = hw.duplex_h2d_bps if cuda else hw.h2d_bps
    kept = min(c.prefetch, len(body))
    bwd_x = [
        0.0 if i < kept or u.index in resident else u.n_total * dt / dup
        for i, u in enumerate(reversed(body))
    ]
    # summed over micro-batches in fp32 on the device (compact: rounded to bf16 as it
    # crosses); a unit updated on the card sends none
    grad_bytes = (2 if c.state != "fp32" else 4) if per_pass > 1 else dt
    grad_down = sum(u.n_total * grad_bytes for u in units if u.index not in card)
    # down while the backward's reloads go up: the link's rate both ways at once
    d2h = grad_down / hw.duplex_down_bps if cuda else 0.0
    bwd, bwd_bus = _pipeline(bwd_c, bwd_x, c.prefetch)
    bwd = max(bwd, d2h)
    # the update on the card: state bytes each way and device seconds, per unit
    up, down, work = {}, {}, {}
    stay = kept_units(a, c, dtype)
    for i in sorted(card):
        up[i], down[i] = card_state_bytes(units[i], c.state, dtype, i in persistent,
                                          i in stay, c.disk_tier)  # fmt: skip
        work[i] = card_work_s(units[i], c.state, hw)
    last, last_bus, card_serial = _last_backward(
        units, body, card, up, down, work, bwd_c, bwd_x, d2h, hw, c.prefetch, timing
    )
    if not card:
        last, last_bus = bwd, bwd_bus
    offload = 0.0
    if c.offload_activations and cuda:
        offload = 2 * offloaded_units(a, c) * a.hidden_bytes(c.micro_batch, dtype) / hw.h2d_bps
        offload *= per_pass
    if hw.host_shares_compute:
        # CPU backend: copies run on the compute thread (inline), so they add
        # to the step rather than hide under it; so do the card's state copies and update
        fwd = sum(fwd_c_all) + sum(h2d_first)
        fwd_later = sum(fwd_c_all) + sum(h2d_later)
        bwd = sum(bwd_c) + sum(bwd_x)
        last = bwd + sum((up[i] + down[i]) / hw.h2d_bps + work[i] for i in card)
        card_serial = 0.0
    overhead = (2 * len(units) - 1) * per_pass * hw.unit_overhead_s
    # the first pass loads every unit not kept across steps; the card updates run in the
    # last (the first, unit-major)
    device = fwd + offload + overhead + (passes - 1) * (fwd_later + offload + overhead)
    device += (passes - 1) * bwd + last
    host_units = [u for u in units if u.index not in card]
    n_host = sum(u.n_owned for u in host_units)
    # Host side, on one worker thread: each unit's gradient lands once per pass (a copy or
    # an add into the fp32 host gradient), then the unit updates (norm, Adam, bf16 refresh).
    landing = passes * n_host * hw.accum_s_per_param
    adam = host_update_s_per_param(c.state, hw)
    # plus each unit's update call: its Python, not its parameters (tens of units of a
    # small model on a CPU: a few ms a step)
    optimizer = n_host * adam + len(host_units) * hw.unit_update_overhead_s
    # the card's new state lands in host memory on the same worker: a copy, which moves
    # twice its bytes through DRAM (an fp32 add, accum_s_per_param, moves 12 a parameter)
    card_land = 2 * sum(down.values()) * hw.accum_s_per_param / 12 if cuda else 0.0
    disk_io = first_read = 0.0
    disk_bound = False  # the disk's reads and writes outlast the host's updates
    if c.disk_tier:
        # every unit's record is read before its update and written back after it; reads
        # and writes share the disk, and run ahead of / behind the updates
        records = a.record_bytes(c.state)
        disk_io = sum(records) * (1 / hw.disk_read_bps + 1 / hw.disk_write_bps)
        first_read = records[0] / hw.disk_read_bps
        disk_bound = disk_io > optimizer
        optimizer = max(optimizer, disk_io)
    if hw.host_shares_compute:
        tail = optimizer + landing  # the CPU backend's host work takes the same cores
    else:
        # the embedding's update must end before the next step's forward can load it
        first_unit = 0.0 if 0 in card else units[0].n_owned * adam + first_read
        if timing != "exact":
            # landings and updates run as gradients arrive, under the rest of the backward
            # and the next step's forward
            tail = max(first_unit, landing + optimizer + card_land - last - fwd)
        else:
            # exact (with clipping): updates wait for the last landing; then the card's
            # run one after another, the host's in forward order under them and the next
            # step's forward
            tail = max(0.0, landing - passes * bwd) + max(
                0.0, first_unit - card_serial, optimizer + card_land - card_serial - fwd
            )
    step = device + card_serial + tail
    compute_s = passes * (sum(fwd_c_all) + sum(bwd_c)) + sum(work.values())
    bus_s = fwd_bus + (passes - 1) * (fwd_later_bus + bwd_bus) + last_bus + card_serial
    bottleneck = "bus" if bus_s > 0.1 * step else ("host" if tail > 0.25 * step else "compute")
    if disk_bound and tail > 0.25 * step:
        bottleneck = "disk"  # the step's tail is the NVMe tier's reads and writes
    tokens = c.micro_batch * c.grad_accum * a.cfg.model.seq_len
    first_fwd = sum(u.n_total for u in units if u.index not in persistent) * dt
    later_fwd = sum(u.n_total for u in units if u.index not in resident) * dt
    reloaded = [u for i, u in enumerate(reversed(body)) if i >= kept and u.index not in resident]
    one_bwd = sum(u.n_total for u in reloaded) * dt
    h2d_bytes = first_fwd + (passes - 1) * later_fwd + passes * one_bwd
    offload_bytes = (
        2 * offloaded_units(a, c) * a.hidden_bytes(c.micro_batch, dtype) * c.grad_accum
        if cuda
        else 0
    )
    disk_bytes = sum(a.record_bytes(c.state)) if c.disk_tier else 0
    # every byte through host DRAM a step (issue 49): DMA both ways, the landings' copies,
    # the host's updates, the disk's transfers
    hg = dtype_bytes(master_dtype(c.state))  # the host gradient's element
    dram = {
        "weights_up": h2d_bytes,
        "grads_down": passes * grad_down,
        # a landing reads the staging pool and writes (first pass) or adds into the host
        # gradient (later passes: it reads that too)
        "grad_landing": sum(u.n_total for u in host_units)
        * (grad_bytes + hg + (passes - 1) * (grad_bytes + 2 * hg)),
        "host_update": n_host * update_dram_bytes(c.state, dtype),
        # the card update's state: up by DMA; down into staging, then copied into place
        "card_state": sum(up.values()) + CARD_DOWN_DRAM_PASSES * sum(down.values()),
        "offload": offload_bytes,
        "disk": 2 * disk_bytes,
    }
    host_dram = host_floor_s(sum(dram.values()), hw)
    pipeline_s, step = step, max(step, host_dram)
    if host_dram and host_dram >= pipeline_s:
        bottleneck = "host memory"
    return Prediction(
        step_s=step,
        tokens_per_s=tokens / step,
        peak_device_bytes=peak_device_bytes(a, c, dtype, cuda),
        host_bytes=host_bytes(a, c, dtype, cuda),
        bottleneck=bottleneck,
        detail={
            "forward_s": fwd,
            "backward_s": last,
            "optimizer_tail_s": tail,
            "compute_s": compute_s,
            "bus_stall_s": bus_s,
            # weights to the device (the card's optimizer state: state_up_bytes)
            "h2d_bytes_per_step": h2d_bytes,
            "d2h_grad_bytes_per_step": passes * grad_down,
            # the update on the card: its optimizer state over the bus each way, its time
            # on the device, and (exact clipping) the serial phase after the backward
            "state_up_bytes": sum(up.values()),
            "state_down_bytes": sum(down.values()),
            "card_update_device_s": sum(work.values()),
            "card_update_serial_s": card_serial,
            "host_update_s": optimizer + landing,
            # activation offload: each checkpointed unit input goes to the host and back
            "offload_bytes_per_step": offload_bytes,
            "disk_bytes": disk_bytes,
            "disk_io_s": disk_io,
            # the NVMe tier: every unit's record read before its update, written after it
            "disk_read_bytes": disk_bytes,
            "disk_write_bytes": disk_bytes,
            # bytes through host DRAM a step, by what moves them; the least time they take
            # at hw.host_mem_bps (0: not charged), and the step without that floor
            "host_dram_bytes": sum(dram.values()),
            "host_dram": dram,
            "host_dram_s": host_dram,
            "pipeline_s": pipeline_s,
            # page-locked on CUDA: every unit's compute copy, the D2H staging pool, the
            # offloaded unit inputs' buffers, and the state of units updated on the card
            "pinned_bytes": (
                sum(u.n_total for u in units if u.index not in stay) * dt
                + staging_bytes(a, c, dtype)
                + (offloaded_bytes(a, c, dtype) if c.offload_activations else 0)
                + card_pinned_bytes(a, c, dtype)
                + tier_pinned_bytes(a, c)
            )
            if cuda
            else 0,
        },
    )


def _last_backward(
    units, body, card, up, down, work, bwd_c, bwd_x, d2h, hw, prefetch, timing
) -> tuple[float, float, float]:
    """(backward time, its bus stall, serial card phase) of the step's last pass with the
    card's updates in it. Overlapped (no clipping, or eager): a unit updates as its
    backward ends, its state's copy up sharing the H2D link with later units' reloads
    (behind the next unit's compute), its copy down the D2H link with their gradients,
    its device time added to its backward. Exact: after the backward, one unit after
    another (each the slowest of its copy up, its copy down and its update)."""
    if not card:
        return 0.0, 0.0, 0.0
    cuda = hw.device == "cuda"
    dup = hw.duplex_h2d_bps if cuda else hw.h2d_bps
    d2h_bps = hw.duplex_down_bps if cuda else float("inf")
    if timing == "exact":
        serial = sum(max(up[i] / dup, down[i] / d2h_bps, work[i]) for i in sorted(card))
        bwd, bus = _pipeline(bwd_c, bwd_x, prefetch)
        return max(bwd, d2h), bus, serial
    # stages: the backward's, then two for copies that outlast it
    comp, xfer = list(bwd_c) + [0.0, 0.0], list(bwd_x) + [0.0, 0.0]
    for stage, u in enumerate([units[-1], *reversed(body)], start=-1):  # head: -1
        if u.index in card:
            comp[max(stage, 0)] += work[u.index]
            xfer[stage + 2] += up[u.index] / dup
    bwd, bus = _pipeline(comp, xfer, prefetch)
    return max(bwd, d2h + sum(down.values()) / d2h_bps), bus, 0.0


def host_floor_s(dram_bytes: float, hw: HardwareSpec) -> float:
    """The least time a step's host DRAM traffic takes: its bytes over the host's memory
    bandwidth; 0 where that is unknown, or on the CPU backend (whose measured rates already
    are host memory's)."""
    if hw.host_mem_bps <= 0 or hw.host_shares_compute:
        return 0.0
    return dram_bytes / hw.host_mem_bps
