"""The tiered plan: a model whose bf16 weights do not fit the card and whose optimizer state
does not fit RAM, each byte of a step placed on the card, in RAM or on an NVMe disk (issue
43); and what the plan costs the disk.

The shape: unit-major over all the step's micro-batches (a unit's weights cross the bus once
in the forward and once in the backward, and its gradient is summed in fp32 on the card over
every micro-batch: no host gradient exists), every unit updated on the card as its backward
ends (its optimizer state streamed up from RAM or the disk a chunk at a time, and back:
cost.py prices it as the card update it is), as many block units kept on the card across
steps as fit (swap.resident_units: their weights never cross the bus), then the unit
inputs kept on the card as far as it has room (those nearest the head, which the backward
needs first) and the rest offloaded. The RAM the plan may use (--host-mem) holds what the
engine holds whatever the split (the D2H staging pool on CUDA, compact state's scratch)
and, whole units at a time, in this order:

  weights      the compute copy, from the head's side: a unit's on the disk is read twice a
               step (forward, backward; once where the unit stays on the card across the
               turn) and written once (the update); the disk takes units 0, 1, ...
  state        master and moments as the engine's tier record holds them (compact state:
               the bf16 master, its 16-bit remainder, the 8-bit moments and block scales);
               read once and written once a step. All of it or none: swap.disk_dir pages
               every unit's state, so anything on the disk puts the state there
  activations  the offloaded unit inputs of all micro-batches, from the head's side:
               written in the forward, read in the backward

and each kind on the disk brings its RAM slots (the tier's records, the weights loaded
ahead, the inputs in flight). The disk's bytes are the engine's: 4 KiB-aligned records,
as DiskTier and ActivationDisk count them.

Time: one disk serves reads and writes (their times add). The forward's transfers (weights
in, activations out) run under the forward, the backward's (activations, weights and state
in; state and weights out) under the backward; a phase whose disk time is the longer waits
for the disk. Every byte also crosses host DRAM: the step can not be shorter than the plan's
DRAM bytes (cost.predict's, with the disk's reads and writes as the split has them) over the
host's memory bandwidth.

Units with tied weights (GPT's embedding and head) update on the host, from a host
gradient: no tiered plan for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from atom.optim.compact import BLOCK, CHUNK, SCRATCH_BUFFERS, padded
from atom.profiler import state_formats
from atom.profiler.analysis import ModelAnalysis, UnitInfo, dtype_bytes
from atom.profiler.cost import (
    TIER_SLOTS,
    Candidate,
    Prediction,
    format_units,
    host_floor_s,
    kept_units,
    predict,
)
from atom.profiler.hardware import GiB, HardwareSpec
from atom.swap.activations import INPUT_SLOTS
from atom.swap.landing import crossing_dtype
from atom.swap.pinned import ALIGN, page_aligned
from atom.swap.weights import weight_slots

# RAM slots of each kind on the disk, the engine's: the state tier's records
# (cost.TIER_SLOTS); the weights' (weights.weight_slots: the device slots' loads, one read
# ahead, one card update's); the unit inputs' (INPUT_SLOTS, one page-aligned input each)
STATE_SLOTS = TIER_SLOTS
# A common consumer drive's rated endurance: 600 TB written for a 1 TB PCIe4 drive
# (Samsung 990 Pro 1TB and WD Black SN850X 1TB data sheets: 600 TBW; 1,200 at 2 TB)
DEFAULT_TBW = 600.0
TB = 1e12


def refused(a: ModelAnalysis, hw: HardwareSpec, optimizer: str) -> str | None:
    """Why no tiered plan can be priced here (None: it can): it updates every unit on the
    device (a CUDA card whose memory bandwidth is known, or the CPU backend's host cores),
    with AdamW, and no unit is tied to another."""
    if hw.device not in ("cuda", "cpu") or (hw.device == "cuda" and hw.card_mem_bps <= 0):
        return "it needs a CUDA card with a known memory bandwidth (card_mem_bps), or the CPU"
    if optimizer != "adamw":
        return f"train.optimizer={optimizer} updates on the host"
    if any(u.tied for u in a.units):
        return "tied weights (the embedding and the head) are updated on the host"
    return None


def ram_state_bytes(u: UnitInfo, state: str, dtype: torch.dtype) -> int:
    """A unit's optimizer state as RAM holds it without a tier: the moments (compact: the
    16-bit remainder too), and the master where it is not the compute copy (another dtype,
    or tied aliases), as atom/swap/host_store.py shares them."""
    n = u.n_owned
    master = state_formats.master_dtype(state)
    if state == "fp32":
        out = 8 * n
    else:
        out = (2 * n if state == "compact" else 0) + 2 * padded(n) + 2 * 4 * padded(n) // BLOCK
    if dtype != master or u.n_total != u.n_owned:
        out += n * dtype_bytes(master)
    return out


def fixed_bytes(a: ModelAnalysis, c: Candidate, dtype: torch.dtype, hw: HardwareSpec) -> int:
    """RAM the engine holds whatever the split: on CUDA the D2H staging pool, one unit in
    the widest dtype that crosses (the card update's state crosses through it in chunks);
    compact state's fp32 scratch (atom/optim/compact.py ChunkScratch)."""
    compact = c.state != "fp32"  # a bf16 host gradient, fp32 scratch
    out = 0
    if hw.device == "cuda":
        item = max(crossing_dtype(d, compact).itemsize for d in (dtype, torch.float32))
        out += a.largest_unit * item
    if compact:
        out += SCRATCH_BUFFERS * min(CHUNK, padded(max(u.n_owned for u in a.units))) * 4
    return out


@dataclass(frozen=True)
class Split:
    """A tiered plan's bytes by what they are and where they live: totals as RAM would hold
    them (the state as the tier's records where it is on the disk), the disk's share as its
    aligned records, and the units on the disk in swap.card_update's syntax."""

    weights: int
    state: int
    acts: int  # offloaded unit inputs, every micro-batch's
    acts_card: int  # unit inputs kept on the card
    staging: int  # the staging pool, scratch, and the RAM slots of what is on the disk
    ram_weights: int
    ram_state: int
    ram_acts: int
    disk_weights: int = 0
    disk_state: int = 0
    disk_acts: int = 0
    reads: int = 0  # bytes read from the disk a step
    writes: int = 0  # bytes written to it a step
    forward_reads: int = 0  # of `reads`, those under the forward (each disk unit's weights)
    weight_units: str = "none"  # units whose compute copy is on the disk
    state_units: str = "none"  # units whose state is on the disk ("all" or "none")
    input_units: str = "none"  # units whose offloaded inputs are on the disk

    @property
    def ram(self) -> int:
        return self.staging + self.ram_weights + self.ram_state + self.ram_acts

    @property
    def on_disk(self) -> int:
        return self.disk_weights + self.disk_state + self.disk_acts

    def to_dict(self) -> dict:
        return asdict(self)


def _ram_from_head(sizes: list[int], free: int) -> int:
    """How many of `sizes` (from the first) go to the disk so that the rest fit `free`."""
    total = sum(sizes)
    for k, size in enumerate(sizes):
        if total <= free:
            return k
        total -= size
    return len(sizes)


def _weights_on_disk(
    a: ModelAnalysis, c: Candidate, w: list[int], free: int, pad: int
) -> tuple[int, int]:
    """(k, slots' bytes): units 0..k-1 keep their weights on the disk, the rest in `free`
    bytes of RAM beside the slots that the disk's weights are loaded through. The head
    and the units kept on the card across steps keep theirs in RAM (the update lands their
    new weights there; they never stream). `pad`: what each slot is asked beyond its record
    (a page on CUDA, to start it on a page boundary)."""
    on_disk = [page_aligned(x) + pad for x in w]
    slots = weight_slots(c.prefetch)
    most = len(w) - 1 - c.resident_units
    k, ring = min(most, _ram_from_head(w, free)), 0
    while k and ring != slots * max(on_disk[:k]):
        ring = slots * max(on_disk[:k])
        k = max(k, min(most, _ram_from_head(w, free - ring)))
    return k, ring


def split(a: ModelAnalysis, c: Candidate, dtype: torch.dtype, hw: HardwareSpec) -> Split:
    dt = dtype_bytes(dtype)
    n, m = len(a.units), c.grad_accum
    # the compute copy of each unit in RAM; none for those whose weights stay on the card
    kept = kept_units(a, c, dtype)
    w = [0 if u.index in kept else u.n_total * dt for u in a.units]
    one = a.hidden_bytes(c.micro_batch, dtype)  # a unit input, one micro-batch's
    n_off = max(0, n - 2 - c.acts_on_card) if c.offload_activations else 0
    offloaded = list(range(1, 1 + n_off))  # their inputs leave the card
    acts = n_off * one * m
    acts_card = (n - 2 - n_off) * one * m if c.checkpoint else 0
    fixed = fixed_bytes(a, c, dtype, hw)
    ram_state = sum(ram_state_bytes(u, c.state, dtype) for u in a.units)
    disk = hw.disk_read_bps > 0 and hw.disk_write_bps > 0
    if not disk or fixed + sum(w) + ram_state + acts <= hw.host_mem:  # all in RAM
        return Split(sum(w), ram_state, acts, acts_card, fixed, sum(w), ram_state, acts)
    # the state on the disk: every unit's record, read before its update, written after
    records = a.record_bytes(c.state)
    # (on CUDA each slot is page-locked a page longer, to start it on a page boundary)
    pad = ALIGN if hw.device == "cuda" else 0
    state_ring = STATE_SLOTS * (max(records) + pad)
    free = hw.host_mem - fixed - state_ring
    per = [one * m] * n_off  # the offloaded inputs of a unit, all micro-batches'
    k, ring = _weights_on_disk(a, c, w, free, pad)
    left = free - ring - sum(w[k:])
    # unit inputs: those of the units nearest the embedding on the disk (written first,
    # read last), every micro-batch's at its own aligned place, through their RAM slots
    act_ring = 0
    if _ram_from_head(per, left):
        act_ring = INPUT_SLOTS * page_aligned(one)
        if left < act_ring:  # the weights make room for the slots
            k, ring = _weights_on_disk(a, c, w, free - act_ring, pad)
            left = free - ring - sum(w[k:])
    j = _ram_from_head(per, left - act_ring)
    on_disk = [page_aligned(x) for x in w]
    # a unit's weights are read in the forward and again in the backward, but for the last
    # units of the forward, which stay on the card for the backward
    body = list(range(n - 1))
    kept = set(body[len(body) - min(c.prefetch, len(body)) :])
    first = sum(on_disk[:k])
    again = sum(on_disk[u] for u in range(k) if u not in kept)
    disk_acts = j * m * page_aligned(one)
    state = sum(records)
    return Split(
        weights=sum(w),
        state=state,
        acts=acts,
        acts_card=acts_card,
        staging=fixed + state_ring + ring + act_ring,
        ram_weights=sum(w[k:]),
        ram_state=0,
        ram_acts=sum(per[j:]),
        disk_weights=sum(on_disk[:k]),
        disk_state=state,
        disk_acts=disk_acts,
        reads=first + again + state + disk_acts,
        writes=sum(on_disk[:k]) + state + disk_acts,
        forward_reads=first,
        weight_units=format_units(set(range(k))),
        state_units="all",
        input_units=format_units(set(offloaded[:j])),
    )


def priced(
    a: ModelAnalysis, c: Candidate, hw: HardwareSpec, times, dtype: torch.dtype
) -> Prediction:
    """cost.predict's step of the card-update shape, with the host RAM of the split and the
    disk's time where it is longer than the phase it runs under."""
    p = predict(a, c, hw, times, dtype)
    s = split(a, c, dtype, hw)
    fwd_disk = bwd_disk = 0.0
    if s.on_disk:
        r, w = hw.disk_read_bps, hw.disk_write_bps
        fwd_disk = s.forward_reads / r + s.disk_acts / w
        bwd_disk = (s.reads - s.forward_reads) / r + (s.writes - s.disk_acts) / w
    wait = max(0.0, fwd_disk - p.detail["forward_s"]) + max(0.0, bwd_disk - p.detail["backward_s"])
    # host DRAM: cost.predict's bytes with the split's disk transfers for the tier's
    dram = {**p.detail["host_dram"], "disk": s.reads + s.writes}
    floor = host_floor_s(sum(dram.values()), hw)
    pipeline = p.detail["pipeline_s"] + wait
    step = max(pipeline, floor)
    bottleneck = "disk" if wait > 0.1 * step else p.bottleneck
    if floor and floor >= pipeline:
        bottleneck = "host memory"
    elif bottleneck == "host memory":  # the floor bound cost.predict's step, not this one
        bottleneck = "disk" if wait else "bus"
    detail = {
        **p.detail,
        "disk_bytes": s.on_disk,
        "disk_io_s": fwd_disk + bwd_disk,
        "disk_wait_s": wait,
        "disk_read_bytes": s.reads,
        "disk_write_bytes": s.writes,
        # on CUDA every byte in RAM crosses the bus: all page-locked
        "pinned_bytes": s.ram if hw.device == "cuda" else 0,
        "tiers": s.to_dict(),
        "host_dram_bytes": sum(dram.values()),
        "host_dram": dram,
        "host_dram_s": floor,
        "pipeline_s": pipeline,
    }
    return Prediction(
        step_s=step,
        tokens_per_s=c.micro_batch * c.grad_accum * a.cfg.model.seq_len / step,
        peak_device_bytes=p.peak_device_bytes,
        host_bytes=s.ram,
        bottleneck=bottleneck,
        detail=detail,
    )


def placements(placer, shape: Candidate) -> list[tuple[Candidate, Prediction]]:
    """A tiered shape's placements (placement.Placer): every update on the card; as many
    block units kept on the card across steps as fit, then as many unit inputs on the card
    as fit beside them, and the other way round (inputs first); with clipping, exact and
    eager. Each names the units its split puts on the disk."""
    clip = placer.cfg.train.grad_clip > 0 and placer.dtype != torch.float16
    out: dict[Candidate, Prediction] = {}
    for upd in ("exact", "eager") if clip else (shape.update,):
        base = replace(shape, update=upd)
        res = placer.most_resident(lambda k, b=base: replace(b, resident_units=k))
        acts = placer.most_resident(lambda k, b=base: replace(b, acts_on_card=k))
        for c in (
            placer.most_resident(lambda k, r=res: replace(r, acts_on_card=k)),
            placer.most_resident(lambda k, x=acts: replace(x, resident_units=k)),
        ):
            if c.offload_activations and c.acts_on_card >= placer.n_blocks:
                c = replace(c, offload_activations=False, acts_on_card=0)  # none offloaded
            s = split(placer.a, c, placer.dtype, placer.hw)
            stay = state_formats.ENGINE_CARD_WEIGHTS_STAY  # no host copy of kept units
            while c.resident_units and s.ram > placer.hw.host_mem and not stay:
                # a unit kept on the card keeps its weights in RAM (unless they stay on
                # the card alone): fewer, where RAM is short
                c = replace(c, resident_units=c.resident_units - 1)
                s = split(placer.a, c, placer.dtype, placer.hw)
            c = replace(c, disk_weights=s.weight_units, disk_state=s.state_units,
                        disk_acts=s.input_units)  # fmt: skip
            if c not in out:
                out[c] = priced(placer.a, c, placer.hw, placer.times, placer.dtype)
    return list(out.items())


def needs(c: Candidate, p: Prediction) -> list[str]:
    """What the engine lacks to run this plan: the tiered plan's parts are all built (issue
    43); the parts of issue 49 that the profiler prices as they land are behind
    state_formats' ENGINE_* constants (the bf16 state; weights that stay on the card are
    counted only where the engine keeps them there, so no plan needs them)."""
    return state_formats.needs(c.state)


def say_bytes(n: float) -> str:
    if n >= TB:
        return f"{n / TB:,.2f} TB"
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 or not n else f"{n / 1e6:,.1f} MB"


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 or not n else f"{n / 2**20:.1f} MiB"


def disk_life(p: Prediction, tbw: float) -> dict:
    """What the plan writes to the disk, and the drive's rated endurance (`tbw`, TB written)
    that a day of training uses."""
    step = p.detail.get("disk_write_bytes", 0)
    hour = step * 3600 / p.step_s
    return {
        "write_bytes_per_step": step,
        "read_bytes_per_step": p.detail.get("disk_read_bytes", 0),
        "write_bytes_per_hour": hour,
        "nvme_tbw": tbw,
        "endurance_per_day": 24 * hour / (tbw * TB),
    }


def disk_note(life: dict) -> str | None:
    """The disk's life in one line; None when the plan writes nothing to disk."""
    if not life["write_bytes_per_step"]:
        return None
    day, tbw = life["endurance_per_day"], life["nvme_tbw"]
    return (
        f"disk: writes {say_bytes(life['write_bytes_per_step'])} a step "
        f"({say_bytes(life['write_bytes_per_hour'])} an hour) and reads "
        f"{say_bytes(life['read_bytes_per_step'])}; a day of training uses {day:.1%} of a "
        f"{tbw:,.0f} TBW drive's rated endurance (--nvme-tbw {tbw:g}): worn out in about "
        f"{1 / day:,.0f} days of training (checkpoints not counted)"
    )


def describe(c: Candidate, p: Prediction) -> list[str]:
    """Where a tiered plan keeps each kind of byte, a line each, naming the units whose
    bytes are on the disk."""
    s = p.detail["tiers"]
    ram_is = "pinned RAM" if p.detail.get("pinned_bytes") else "RAM"

    def where(kind: str, what: str, how: str, units: str) -> str:
        ram, disk = s[f"ram_{kind}"], s[f"disk_{kind}"]
        at = [f"{_size(ram)} in {ram_is}"] if ram else []
        named = "" if units in ("none", "all") else f"units {units}, "
        at += [f"{_size(disk)} on the NVMe disk ({named}{how})"] if disk else []
        return f"{what} ({_size(s[kind])}): " + (", ".join(at) or "none")

    if c.state == "fp32":
        state = "fp32 master + moments"
    elif c.state == "bf16":
        state = "bf16 weights + " * bool(s["disk_state"]) + "8-bit moments"
    else:  # the tier's record holds the bf16 master too; in RAM it is the compute copy
        state = "bf16 master + " * bool(s["disk_state"]) + "remainder + 8-bit moments"
    kept = _size(s["acts_card"])
    card = f"{c.acts_on_card} units' on the card ({kept}), " if c.acts_on_card else ""
    if not c.offload_activations and s["acts_card"]:
        card = f"all on the card ({kept})"
    acts = where("acts", "", "written in the forward, read in the backward", s["input_units"])
    total = _size(s["acts"] + s["acts_card"])
    rest = acts.split(": ", 1)[1] if s["acts"] else ""
    acts = f"unit inputs of {c.grad_accum} micro-batches ({total}): {card}{rest}"
    streamed = "every unit streamed and"
    if c.resident_units:
        streamed = (
            f"{c.resident_units} block unit(s) kept on the card across steps, the others "
            "streamed; each"
        )
    weights = where("weights", "weights (the compute copy)", "read twice a step, written once",
                    s["weight_units"])  # fmt: skip
    return [
        f"tiered: {streamed} updated on the card as its backward ends, its gradient summed "
        f"there over the step's {c.grad_accum} micro-batches (no host gradient)",
        "tiered: " + weights,
        "tiered: " + where("state", state, "read and written once a step", s["state_units"]),
        "tiered: " + acts.rstrip(", "),
    ]


def needs_note(need: list[str], built_host: int | None, looked: bool = True) -> str:
    """The one line that says a plan is not runnable yet, and what is: `built_host`, the
    least RAM of a plan the engine runs (None: none fits; `looked` False: not searched)."""
    if not looked:
        instead = "profile without --tiered for a plan atom trains today"
    elif built_host:
        instead = f"a plan atom trains today needs {built_host / GiB:.1f} GiB of host RAM"
    else:
        instead = "no plan atom trains today fits this card"
    return (
        f"this plan needs {'; '.join(need)}: not built yet, so `atom train "
        f"--plan` refuses it; {instead}"
    )
