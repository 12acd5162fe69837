"""Memory and time models of one swapped training step for a candidate plan.

Peak device bytes (what the engine's ledger counts, plus CUDA-only workspace):
    slots (prefetch + 1) x largest unit
  + checkpointed unit inputs (N - 2 of them, unless offloaded to host)
  + the larger of: one unit's working activations during its recompute + backward, or
    the head's (whose fp32 log-softmax over the vocabulary is often the biggest buffer)
  + one unit's parameter gradient on its way to the host
  + on CUDA: the head backward's transients (logits and their fp32 gradients) and
    allocator slack.
Without checkpointing every block's activations are kept through the forward instead.

Step time: the unit pipeline per micro-batch, each stage max(compute, transfer) at the
chosen prefetch depth, times grad_accum, plus the host optimizer tail.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from atom.config import SwapConfig
from atom.profiler.analysis import ModelAnalysis, dtype_bytes
from atom.profiler.hardware import HardwareSpec
from atom.profiler.timing import PieceTimes


@dataclass(frozen=True)
class Candidate:
    """One plan the profiler weighs: a partition, a batch and a host state. Fields that
    are swap settings carry SwapConfig's names (swap_settings()), so nothing translates."""

    layers_per_unit: int
    prefetch: int
    micro_batch: int
    grad_accum: int
    checkpoint: bool
    offload_activations: bool
    order: str = "unit"  # swap.order: unit-major or micro-batch-major (same when accum 1)
    resident_units: int = 0  # block units kept on the device all step
    state: str = "fp32"  # fp32, or compact (bf16 + 8-bit moments, half the RAM)
    disk_tier: bool = False  # master and moments on disk (swap.disk_dir), paged around updates

    def swap_settings(self) -> dict:
        """The swap section this candidate means (disk_tier aside: the directory is the
        user's, swap.disk_dir)."""
        names = {f.name for f in fields(SwapConfig)}
        return {k: v for k, v in asdict(self).items() if k in names}


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
    slots = (c.prefetch + 1 + c.resident_units) * a.largest_unit * dt
    hidden = a.hidden_bytes(c.micro_batch, dtype)
    block = a.block_activation_bytes(c.micro_batch, dtype)
    head = a.head_activation_bytes(c.micro_batch, dtype)
    lpu = max(u.n_blocks for u in a.units)
    largest_block_unit = max(u.n_total for u in a.units if u.kind == "blocks") * dt
    head_unit = a.units[-1].n_total * dt
    tokens = c.micro_batch * a.cfg.model.seq_len
    # unit-major with several micro-batches: every micro-batch's boundary state is kept at
    # once, the other micro-batches' hidden (or its gradient) waits at the frontier, and
    # a unit's gradient is summed over micro-batches in an fp32 accumulator
    m = c.grad_accum if c.order == "unit" else 1
    frontier = (m - 1) * hidden
    accumulator = a.largest_unit * 4 if m > 1 else 0
    if c.checkpoint:
        kept = 0 if c.offload_activations else (n_units - 2) * hidden * m
        # recompute of a unit: all its blocks' saved tensors, and the inputs of all but the
        # first (that one is the checkpoint, already counted, unless it was offloaded)
        inner_inputs = lpu if c.offload_activations else lpu - 1
        working = max(head + head_unit, lpu * block + inner_inputs * hidden + largest_block_unit)
        peak = slots + kept + working + frontier + accumulator
    else:
        n_layer = a.cfg.model.n_layer
        embed_saved = tokens * 8 + a.cfg.model.seq_len * 8  # token ids, positions (int64)
        # everything saved stays until the backward frees it; the peak comes at the head
        # (its activations + gradient) or at the first block unit's gradient
        peak = (
            slots
            + m * (embed_saved + n_layer * (block + hidden))
            + max(head + head_unit, largest_block_unit)
            + frontier
            + accumulator
        )
    if cuda:
        peak += a.head_workspace_bytes(c.micro_batch, dtype) + 2 * hidden
        peak = int(peak * 1.05)  # caching-allocator rounding and fragmentation
    return int(peak)


def host_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype, cuda: bool) -> int:
    total = a.host_bytes(dtype, c.state, c.disk_tier)
    if cuda:
        total += staging_bytes(a, c, dtype)
    if c.offload_activations:
        total += offloaded_bytes(a, c, dtype)
    return total


def staging_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype) -> int:
    """The pinned D2H staging pool (CUDA): one unit's gradient in the widest dtype that
    crosses (the compute dtype; fp32 sums of several micro-batches, which compact state
    rounds to bf16 as they cross)."""
    item = dtype_bytes(dtype) if c.state == "compact" else 4
    return a.largest_unit * item


def offloaded_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype) -> int:
    """Host bytes of the checkpointed unit inputs kept in host memory at once: every unit
    but the first and the head, for each micro-batch in flight (all of them, unit-major)."""
    m = c.grad_accum if c.order == "unit" else 1
    return (len(a.units) - 2) * a.hidden_bytes(c.micro_batch, dtype) * m


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
    eager: bool = False,
) -> Prediction:
    """Step time of one plan. Unit-major (`c.order == "unit"`) runs the unit pipeline once
    per step with every stage's compute multiplied by grad_accum (each unit crosses the bus
    once per pass); micro-batch-major runs it grad_accum times. `eager`: swap.update=eager,
    units update while the backward of earlier units still runs."""
    cuda = hw.device == "cuda"
    dt = dtype_bytes(dtype)
    units = a.units
    m_total = c.grad_accum
    unit_major = c.order == "unit" or m_total == 1
    per_pass = m_total if unit_major else 1  # micro-batches per unit visit run
    passes = 1 if unit_major else m_total  # times the unit pipeline runs per step
    body = units[:-1]  # embed + block units; the head runs forward and backward at once
    h2d = [u.n_total * dt / hw.h2d_bps for u in units]
    fwd_c = [times.embed / 3 if u.kind == "embed" else u.n_blocks * times.block_fwd for u in body]
    fwd_c_all = [t * per_pass for t in fwd_c + [times.head]]
    # resident units (the block units before the head) are loaded by the first forward
    # only: later passes and every backward find them on the device
    pinned = set(range(len(units) - 1 - c.resident_units, len(units) - 1))
    h2d_later = [0.0 if u.index in pinned else h2d[u.index] for u in units]
    fwd, fwd_bus = _pipeline(fwd_c_all, [h2d[u.index] for u in units], c.prefetch)
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
        0.0 if i < kept or u.index in pinned else u.n_total * dt / dup
        for i, u in enumerate(reversed(body))
    ]
    # summed over micro-batches in fp32 on the device (compact: rounded to bf16 as it crosses)
    grad_bytes = (2 if c.state == "compact" else 4) if per_pass > 1 else dt
    d2h = sum(u.n_total * grad_bytes / hw.d2h_bps for u in units) if cuda else 0.0
    bwd, bwd_bus = _pipeline(bwd_c, bwd_x, c.prefetch)
    bwd = max(bwd, d2h)
    offload = 0.0
    if c.offload_activations and cuda:
        offload = 2 * (len(units) - 2) * a.hidden_bytes(c.micro_batch, dtype) / hw.h2d_bps
        offload *= per_pass
    if hw.host_shares_compute:
        # CPU backend: copies run on the compute thread (inline), so they add
        # to the step rather than hide under it
        fwd = sum(fwd_c_all) + sum(h2d)
        fwd_later = sum(fwd_c_all) + sum(h2d_later)
        bwd = sum(bwd_c) + sum(bwd_x)
    overhead = (2 * len(units) - 1) * per_pass * hw.unit_overhead_s
    one_pass = fwd + bwd + offload + overhead
    later_pass = fwd_later + bwd + offload + overhead
    n = a.n_params
    # Host side, on one worker thread: each unit's gradient lands once per pass (a copy or
    # an add into the fp32 host gradient), then the unit updates (norm, Adam, bf16 refresh).
    landing = passes * n * hw.accum_s_per_param
    adam = hw.compact_adam_s_per_param if c.state == "compact" else hw.adam_s_per_param
    # plus each unit's update call: its Python, not its parameters (tens of units of a
    # small model on a CPU: a few ms a step)
    optimizer = n * adam + len(units) * hw.unit_update_overhead_s
    disk_io = first_read = 0.0
    if c.disk_tier:
        # every unit's record is read before its update and written back after it; reads
        # and writes share the disk, and run ahead of / behind the updates
        records = a.record_bytes(c.state)
        disk_io = sum(records) * (1 / hw.disk_read_bps + 1 / hw.disk_write_bps)
        first_read = records[0] / hw.disk_read_bps
        optimizer = max(optimizer, disk_io)
    if hw.host_shares_compute:
        tail = optimizer + landing  # the CPU backend's host work takes the same cores
    else:
        first_unit = units[0].n_owned * adam + first_read
        if eager:
            # landings and updates run as gradients arrive, under the rest of the backward
            # and the next step's forward
            tail = max(first_unit, landing + optimizer - bwd - fwd)
        else:
            # exact (with clipping): updates wait for the last landing, then run in forward
            # order under the next step's forward
            tail = max(0.0, landing - passes * bwd) + max(first_unit, optimizer - fwd)
    step = one_pass + (passes - 1) * later_pass + tail
    compute_s = passes * (sum(fwd_c_all) + sum(bwd_c))
    bus_s = fwd_bus + (passes - 1) * fwd_later_bus + passes * bwd_bus
    bottleneck = "bus" if bus_s > 0.1 * step else ("host" if tail > 0.25 * step else "compute")
    tokens = c.micro_batch * c.grad_accum * a.cfg.model.seq_len
    first_fwd = sum(u.n_total for u in units) * dt
    later_fwd = sum(u.n_total for u in units if u.index not in pinned) * dt
    one_bwd = sum(
        u.n_total * dt for i, u in enumerate(reversed(body)) if i >= kept and u.index not in pinned
    )
    return Prediction(
        step_s=step,
        tokens_per_s=tokens / step,
        peak_device_bytes=peak_device_bytes(a, c, dtype, cuda),
        host_bytes=host_bytes(a, c, dtype, cuda),
        bottleneck=bottleneck,
        detail={
            "forward_s": fwd,
            "backward_s": bwd,
            "optimizer_tail_s": tail,
            "compute_s": compute_s,
            "bus_stall_s": bus_s,
            "h2d_bytes_per_step": first_fwd + (passes - 1) * later_fwd + passes * one_bwd,
            # activation offload: each checkpointed unit input goes to the host and back
            "offload_bytes_per_step": (
                2 * (len(units) - 2) * a.hidden_bytes(c.micro_batch, dtype) * c.grad_accum
                if c.offload_activations and cuda
                else 0
            ),
            "disk_bytes": sum(a.record_bytes(c.state)) if c.disk_tier else 0,
            "disk_io_s": disk_io,
            # page-locked on CUDA: every unit's compute copy, the D2H staging pool and
            # the offloaded unit inputs' buffers
            "pinned_bytes": (
                sum(u.n_total for u in units) * dt
                + staging_bytes(a, c, dtype)
                + (offloaded_bytes(a, c, dtype) if c.offload_activations else 0)
            )
            if cuda
            else 0,
        },
    )
