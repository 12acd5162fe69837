"""The tiered plan: a model whose bf16 weights do not fit the card and whose optimizer state
does not fit RAM, each byte of a step placed on the card, in pinned RAM or on an NVMe disk
(issue 43); and what the plan costs the disk.

The shape: unit-major over all the step's micro-batches (a unit's weights cross the bus once
in the forward and once in the backward, and its gradient is summed in fp32 on the card over
every micro-batch: no host gradient exists), every unit updated on the card while it is
resident in its backward (its optimizer state streamed up from RAM or the disk a chunk at a
time, and back: cost.py prices it as the card update it is), the unit inputs kept on the
card as far as it has room (those nearest the head, which the backward needs first) and
the rest offloaded. The RAM the plan may use (--host-mem) holds, after the pinned chunks
that stage the disk's transfers, in this order:

  weights      the bf16 compute copy (in compact state also the master's upper half); a
               byte of them on the disk is read twice a step (forward, backward) and
               written once (the update)
  state        the remainder and the 8-bit moments (fp32 state: master and moments); read
               once, written once
  activations  the offloaded unit inputs: written in the forward, read in the backward

and what does not fit goes to the disk. Weights first: they are read twice. State and
activations cost the disk the same per byte; the state comes first (issue 43: moments in
RAM before checkpoints). Nothing is written that the step did not change: an activation
once, weights and state once after their update.

Time: one disk serves reads and writes (their times add). The forward's transfers (weights
in, activations out) run under the forward, the backward's (activations, weights and state
in; state and weights out) under the backward; a phase whose disk time is the longer waits
for the disk. Host memory bandwidth (every byte also crosses DRAM) is not charged.

Units with tied weights (GPT's embedding and head) update on the host, from a host
gradient: no tiered plan for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from atom.optim.compact import BLOCK, padded
from atom.profiler.analysis import ModelAnalysis, dtype_bytes
from atom.profiler.cost import Candidate, Prediction, offloaded_units, predict
from atom.profiler.hardware import GiB, HardwareSpec
from atom.swap.card_update import DEVICE_CHUNK

# Pinned RAM through which the disk's reads and writes pass, a ring of chunks (a unit is
# read ahead and written behind chunk by chunk, never whole): at most this, and at most
# RING_UNITS units' weights and state (a small model's units are small)
DISK_RING_BYTES = 2 * GiB
RING_UNITS = 2
# A common consumer drive's rated endurance: 600 TB written for a 1 TB PCIe4 drive
# (Samsung 990 Pro 1TB and WD Black SN850X 1TB data sheets: 600 TBW; 1,200 at 2 TB)
DEFAULT_TBW = 600.0
TB = 1e12


def refused(a: ModelAnalysis, hw: HardwareSpec, optimizer: str) -> str | None:
    """Why no tiered plan can be priced here (None: it can): it updates every unit on a
    card whose memory bandwidth is known, with AdamW, and no unit is tied to another."""
    if hw.device != "cuda" or hw.card_mem_bps <= 0:
        return "it needs a CUDA card with a known memory bandwidth (card_mem_bps)"
    if optimizer != "adamw":
        return f"train.optimizer={optimizer} updates on the host"
    if any(u.tied for u in a.units):
        return "tied weights (the embedding and the head) are updated on the host"
    return None


def state_bytes(n: int, state: str) -> int:
    """A unit's optimizer state beyond its bf16 weights: compact, the 16-bit remainder and
    two 8-bit moments with their block scales; fp32, the master and both moments."""
    if state == "compact":
        return 2 * n + 2 * padded(n) + 2 * 4 * padded(n) // BLOCK
    return 12 * n


@dataclass(frozen=True)
class Split:
    """A tiered plan's bytes by what they are and where they live."""

    weights: int
    state: int
    acts: int  # offloaded unit inputs, every micro-batch's
    acts_card: int  # unit inputs kept on the card
    staging: int  # pinned chunks for the disk's transfers and the state's crossings
    ram_weights: int
    ram_state: int
    ram_acts: int

    @property
    def disk_weights(self) -> int:
        return self.weights - self.ram_weights

    @property
    def disk_state(self) -> int:
        return self.state - self.ram_state

    @property
    def disk_acts(self) -> int:
        return self.acts - self.ram_acts

    @property
    def ram(self) -> int:
        return self.staging + self.ram_weights + self.ram_state + self.ram_acts

    @property
    def on_disk(self) -> int:
        return self.disk_weights + self.disk_state + self.disk_acts

    @property
    def reads(self) -> int:
        return 2 * self.disk_weights + self.disk_state + self.disk_acts

    @property
    def writes(self) -> int:
        return self.on_disk

    def to_dict(self) -> dict:
        return {**asdict(self), "disk_weights": self.disk_weights,
                "disk_state": self.disk_state, "disk_acts": self.disk_acts}  # fmt: skip


def split(a: ModelAnalysis, c: Candidate, dtype: torch.dtype, hw: HardwareSpec) -> Split:
    weights = sum(u.n_total for u in a.units) * dtype_bytes(dtype)
    state = sum(state_bytes(u.n_owned, c.state) for u in a.units)
    one = a.hidden_bytes(c.micro_batch, dtype) * c.grad_accum  # a unit input, all micro-batches
    acts, acts_card = offloaded_units(a, c) * one, c.acts_on_card * one
    pool = 2 * min(a.largest_unit, DEVICE_CHUNK) * (state_bytes(BLOCK, c.state) // BLOCK + 2)
    disk = hw.disk_read_bps > 0 and hw.disk_write_bps > 0
    if not disk or pool + weights + state + acts <= hw.host_mem:  # all in RAM
        return Split(weights, state, acts, acts_card, pool, weights, state, acts)
    largest = max(u.n_total * dtype_bytes(dtype) + state_bytes(u.n_owned, c.state)
                  for u in a.units)  # fmt: skip
    ring = min(DISK_RING_BYTES, RING_UNITS * largest)
    free = max(0, hw.host_mem - pool - ring)
    ram = []
    for need in (weights, state, acts):
        ram.append(min(need, free))
        free -= ram[-1]
    return Split(weights, state, acts, acts_card, pool + ring, *ram)


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
        fwd_disk = s.disk_weights / r + s.disk_acts / w
        bwd_disk = (s.disk_acts + s.disk_weights + s.disk_state) / r + (
            s.disk_weights + s.disk_state
        ) / w
    wait = max(0.0, fwd_disk - p.detail["forward_s"]) + max(0.0, bwd_disk - p.detail["backward_s"])
    step = p.step_s + wait
    detail = {
        **p.detail,
        "disk_bytes": s.on_disk,
        "disk_io_s": fwd_disk + bwd_disk,
        "disk_wait_s": wait,
        "disk_read_bytes": s.reads,
        "disk_write_bytes": s.writes,
        "pinned_bytes": s.ram,  # every byte in RAM crosses the bus: all page-locked
        "tiers": s.to_dict(),
    }
    return Prediction(
        step_s=step,
        tokens_per_s=c.micro_batch * c.grad_accum * a.cfg.model.seq_len / step,
        peak_device_bytes=p.peak_device_bytes,
        host_bytes=s.ram,
        bottleneck="disk" if wait > 0.1 * step else p.bottleneck,
        detail=detail,
    )


def placements(placer, shape: Candidate) -> list[tuple[Candidate, Prediction]]:
    """A tiered shape's placements (placement.Placer): every update on the card, as many unit
    inputs on the card as fit; with clipping, exact and eager."""
    clip = placer.cfg.train.grad_clip > 0 and placer.dtype != torch.float16
    out = []
    for upd in ("exact", "eager") if clip else (shape.update,):
        c = placer.most_resident(lambda k, upd=upd: replace(shape, update=upd, acts_on_card=k))
        out.append((c, priced(placer.a, c, placer.hw, placer.times, placer.dtype)))
    return out


def needs(c: Candidate, p: Prediction) -> list[str]:
    """What the engine lacks to run this plan (nothing for the shapes it runs)."""
    if not c.tiered:
        return []
    s = p.detail["tiers"]
    out = ["no host gradient for units updated on the card (the host store keeps one for "
           "every unit)"]  # fmt: skip
    if s["disk_state"]:
        out.append("the update on the card with its state on the NVMe tier (swap.card_update "
                   "refuses swap.disk_dir)")  # fmt: skip
    if s["disk_weights"]:
        out.append("weights on the NVMe tier (it keeps every unit's bus copy in RAM)")
    if s["disk_acts"]:
        out.append("unit inputs offloaded to the NVMe tier (swap.offload_activations keeps "
                   "them in RAM)")  # fmt: skip
    if c.acts_on_card:
        out.append("some unit inputs kept on the card and the rest offloaded "
                   "(swap.offload_activations offloads all or none)")  # fmt: skip
    return out


def say_bytes(n: float) -> str:
    return f"{n / TB:,.2f} TB" if n >= TB else f"{n / 1e9:,.1f} GB"


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
    """Where a tiered plan keeps each kind of byte, a line each."""
    s = p.detail["tiers"]

    def where(kind: str, what: str, how: str) -> str:
        ram, disk = s[f"ram_{kind}"], s[f"disk_{kind}"]
        at = [f"{ram / GiB:.1f} GiB in pinned RAM"] if ram else []
        at += [f"{disk / GiB:.1f} GiB on the NVMe disk ({how})"] if disk else []
        return f"{what} ({s[kind] / GiB:.1f} GiB): " + (", ".join(at) or "none")

    state = "remainder + 8-bit moments" if c.state == "compact" else "fp32 master + moments"
    card = (
        f"{c.acts_on_card} units' on the card ({s['acts_card'] / GiB:.1f} GiB), "
        if c.acts_on_card
        else ""
    )
    acts = where("acts", f"unit inputs of {c.grad_accum} micro-batches", "written in the "
                 "forward, read in the backward")  # fmt: skip
    total = (s["acts"] + s["acts_card"]) / GiB
    acts = f"unit inputs of {c.grad_accum} micro-batches ({total:.1f} GiB)" + acts.split(")", 1)[1]
    return [
        "tiered: every unit streamed and updated on the card as its backward ends, its "
        f"gradient summed there over the step's {c.grad_accum} micro-batches (no host "
        "gradient)",
        "tiered: " + where("weights", "bf16 weights", "read twice a step, written once"),
        "tiered: " + where("state", state, "read and written once a step"),
        "tiered: " + acts.replace(": ", ": " + card, 1),
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
        f"this plan needs {'; '.join(need)}: not built yet (issue 43), so `atom train "
        f"--plan` refuses it; {instead}"
    )
