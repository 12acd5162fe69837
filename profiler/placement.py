"""Where each unit lives: its weights kept on the card (swap.resident_units) or streamed
each step, and its optimizer update run on the card (swap.card_update) or on the host.

For one shape of plan (partition, prefetch, batch, checkpointing, host state) the planner
tries a few placements, greedily, and scores each:

- none on the card: every update on the host, as many block units resident as fit;
- the resident units updated on the card (they then stay there across steps: their weights
  never cross the bus again, only their optimizer state); and a quarter, half and three
  quarters of them (fp32 state crosses at 12 bytes a parameter each way: where the bus
  binds, a unit's weights and host update may cost less);
- and the streamed units too, the embedding first (its host update gates the next step),
  then the ones nearest the head, as many as it takes for the host's update of the rest
  to hide under the step (and the embedding alone, the embedding and the head);
- every unit that can (a unit tied to another stays on the host).

With clipping (train.grad_clip > 0) each placement with card units is scored twice: exact
(card units' fp32 gradients wait on the card for the step's global norm, then update one
after another) and eager (each unit clips by the previous step's norm as its backward
ends). Each time as many block units resident as fit the device.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from atom.config import Config
from atom.profiler import tiers
from atom.profiler.analysis import ModelAnalysis, UnitInfo
from atom.profiler.cost import (
    Candidate,
    Prediction,
    card_units,
    format_units,
    host_bytes,
    peak_device_bytes,
    predict,
    resident_set,
)
from atom.profiler.hardware import GiB, HardwareSpec
from atom.profiler.timing import PieceTimes

# the host's update counts as hidden under the step when what it adds is this small
HIDDEN_SHARE = 0.05


def card_allowed(cfg: Config, shape: Candidate, hw: HardwareSpec) -> str | None:
    """Why no update of this shape can run on the card, or None where it can (on the NVMe
    tier too: the update pages its unit's record in around it, as the host's does)."""
    if cfg.train.optimizer != "adamw":
        return f"train.optimizer={cfg.train.optimizer} updates on the host"
    if hw.device == "cuda" and hw.card_mem_bps <= 0:
        return "the hardware spec has no card_mem_bps to price an update on the card"
    return None


class Placer:
    """The placements of one shape, each scored (see the module's docstring)."""

    def __init__(
        self,
        cfg: Config,
        a: ModelAnalysis,
        hw: HardwareSpec,
        times: PieceTimes,
        dtype: torch.dtype,
    ):
        self.cfg, self.a, self.hw, self.times, self.dtype = cfg, a, hw, times, dtype
        self.cuda = hw.device == "cuda"
        self.n_blocks = len(a.units) - 2
        units = a.units
        # the order streamed units move to the card: the embedding first (its host update
        # is the last of a step and gates the next step's forward), then from the head
        # back (their updates overlap more of the backward)
        self.order = [u.index for u in [units[0], units[-1], *reversed(units[1:-1])]
                      if not u.tied]  # fmt: skip
        self._fits: dict[Candidate, bool] = {}

    def fits(self, c: Candidate) -> bool:
        if c not in self._fits:
            peak = peak_device_bytes(self.a, c, self.dtype, self.cuda)
            self._fits[c] = peak <= self.hw.device_mem
        return self._fits[c]

    def most_resident(self, make) -> Candidate:
        """`make(k)` with the largest k (block units kept on the device) that fits; k = 0
        when none does."""
        lo, hi = 0, self.n_blocks
        if self.fits(make(hi)):
            return make(hi)
        while hi - lo > 1:  # fits(lo) or lo == 0; not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(make(mid)) else (lo, mid)
        return make(lo)

    def resident(self, k: int) -> set[int]:
        n = len(self.a.units)
        return set(range(n - 1 - k, n - 1)) & set(self.order)

    def placements(self, shape: Candidate) -> list[tuple[Candidate, Prediction]]:
        if shape.tiered:
            return tiers.placements(self, shape)
        scored: dict[Candidate, Prediction] = {}

        def score(c: Candidate) -> Prediction:
            if c not in scored:
                scored[c] = predict(self.a, c, self.hw, self.times, self.dtype)
            return scored[c]

        def at(upd: str, card) -> Candidate:
            """The placement with `card(k)` on the card and the most resident units."""

            def make(k: int) -> Candidate:
                return replace(shape, resident_units=k, card_update=format_units(card(k)),
                               update=upd)  # fmt: skip

            return self.most_resident(make)

        score(at(shape.update, lambda k: set()))
        if card_allowed(self.cfg, shape, self.hw) is not None or not self.order:
            return list(scored.items())
        clip = self.cfg.train.grad_clip > 0 and self.dtype != torch.float16
        # every unit on the card needs the least host RAM (no host gradient): where even
        # that does not fit, the one placement worth weighing is the one with the most
        # units on the card that fits it (the least RAM a plan of this shape needs)
        lean = replace(shape, card_update=format_units(set(self.order)))
        short = host_bytes(self.a, lean, self.dtype, self.cuda) > self.hw.host_mem
        for upd in ("exact", "eager") if clip else (shape.update,):
            score(at(upd, lambda k: set(self.order)))
            if short:
                lo, hi = 0, len(self.order)
                while hi - lo > 1:  # fits with lo units on the card (or lo == 0), none kept
                    mid = (lo + hi) // 2
                    card = format_units(self._on_card(0, mid)(0))
                    fits = self.fits(replace(shape, card_update=card, update=upd))
                    lo, hi = (mid, hi) if fits else (lo, mid)
                score(at(upd, self._on_card(0, lo)))
                continue
            # the resident units on the card, or as many of them as is fastest, those
            # nearest the head (each trades its weights' copies and its host update for
            # its state's copies: where the bus binds, fewer may be faster)
            k = at(upd, self.resident).resident_units
            j = _argmin(partial(self._rank, at, score, upd), 0, k)
            best = at(upd, self._on_card(j, 0))
            if not self._host_binds(score(best)):
                continue
            # then streamed units, the fewest that hide the host's update; and the
            # embedding alone, the embedding and the head
            lo, hi = 0, len(self.order)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                binds = self._host_binds(score(at(upd, self._on_card(j, mid))))
                lo, hi = (mid, hi) if binds else (lo, mid)
            for m in {1, 2, hi}:
                score(at(upd, self._on_card(j, m)))
        return list(scored.items())

    def _rank(self, at, score, upd: str, j: int) -> tuple[bool, float]:
        c = at(upd, self._on_card(j, 0))
        return (not self.fits(c), score(c).step_s)

    def _on_card(self, j: int, m: int):
        """Of the resident units the `j` nearest the head on the card, and the first `m` of
        the others in `order`."""

        def card(k: int) -> set[int]:
            res = self.resident(min(k, j))
            return res | set([i for i in self.order if i not in res][:m])

        return card

    @staticmethod
    def _host_binds(p: Prediction) -> bool:
        return p.detail["optimizer_tail_s"] > HIDDEN_SHARE * p.step_s


def _argmin(f, lo: int, hi: int) -> int:
    """The integer in [lo, hi] where f is least, for an f that falls then rises (ternary
    search: a few dozen evaluations at most)."""
    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if f(a) <= f(b):
            hi = b
        else:
            lo = a
    return min(range(lo, hi + 1), key=f)


# ------------------------------------------------------------------ in words
def _names(a: ModelAnalysis, group: list[int]) -> str:
    """'unit 0 (the embedding)', 'units 1-32 (blocks 0-31)', 'units 0 and 33 (the
    embedding, the head)'."""
    ids = format_units(set(group)).replace(",", ", ")
    if len(group) == 2 and group[1] != group[0] + 1:
        ids = f"{group[0]} and {group[1]}"
    kinds = {a.units[i].kind for i in group}
    parts = ["the embedding"] if "embed" in kinds else []
    blocks: set[int] = set()  # model block numbers
    for i in group:
        if a.units[i].kind == "blocks":
            first = sum(u.n_blocks for u in a.units[:i])
            blocks.update(range(first, first + a.units[i].n_blocks))
    if blocks:
        named = format_units(blocks).replace(",", ", ")
        parts.append(f"block{'s' if len(blocks) > 1 else ''} {named}")
    if "head" in kinds:
        parts.append("the head")
    return f"unit{'s' if len(group) > 1 else ''} {ids} ({', '.join(parts)})"


def describe(
    cfg: Config, a: ModelAnalysis, c: Candidate, hw: HardwareSpec, times, dtype
) -> list[dict]:
    """Per group of units that live alike: which units, where their weights live and where
    their update runs, and why, in words (`atom profile` prints it, plan.json keeps it)."""
    card, resident = card_units(a, c), resident_set(a, c)
    p = predict(a, c, hw, times, dtype)
    placer = Placer(cfg, a, hw, times, dtype)
    blocked = card_allowed(cfg, c, hw)

    def key(u: UnitInfo) -> tuple[str, str, bool]:
        # streamed block units (no room) apart from the embedding and head (never kept)
        return ("resident" if u.index in resident else "streamed",
                "card" if u.index in card else "host", u.kind == "blocks")  # fmt: skip

    groups: dict[tuple[str, str, bool], list[int]] = {}
    for u in a.units:
        groups.setdefault(key(u), []).append(u.index)
    out = []
    for (weights, where, _), ids in sorted(groups.items(), key=lambda g: g[1][0]):
        moved = card - set(ids) if where == "card" else card | set(ids)
        other = replace(c, card_update=format_units(moved))
        if weights == "resident" and where == "card":
            what = "weights stay on the card across steps, updated on the card"
        elif weights == "resident":
            what = "weights on the card all step (loaded once a step), updated on the host"
        else:
            what = f"streamed, updated on the {where}"
        out.append({
            "units": format_units(set(ids)),
            "weights": weights,
            "update": where,
            "says": f"{_names(a, ids)}: {what}",
            "why": _why(a, c, p, other, ids, weights, where, blocked, placer),
        })  # fmt: skip
    return out


def _why(a, c, p, other, ids, weights, where, blocked, placer) -> str:
    units = [a.units[i] for i in ids]
    its = "its" if len(units) == 1 else "their"
    reasons = []
    if weights == "streamed" and any(u.kind == "blocks" for u in units):
        reasons.append("the card has no room to keep more units")
    elif weights == "streamed":
        reasons.append("only block units are kept on the card")
    else:
        reasons.append("the card has room to keep them")
    if where == "host":
        if all(u.tied for u in units):
            reasons.append("tied weights are updated on the host")
        elif blocked is not None:
            reasons.append(blocked)
        elif not placer.fits(other):
            reasons.append(f"{its} update on the card (an fp32 gradient sum) does not fit")
        else:
            alt = predict(a, other, placer.hw, placer.times, placer.dtype)
            reasons.append(
                f"{its} update on the host hides under the step (on the card a step would "
                f"take {alt.step_s:.2f} s against {p.step_s:.2f})"
            )
    else:
        alt = predict(a, other, placer.hw, placer.times, placer.dtype)
        n = sum(u.n_owned for u in units)
        reasons.append(
            f"on the host {its} update ({n / 1e9:.2f}B parameters) would make a step "
            f"{alt.step_s:.2f} s against {p.step_s:.2f}"
            if alt.step_s > p.step_s * 1.001
            else "as fast as on the host"
        )
    return "; ".join(reasons)


def clipping_note(cfg: Config, c: Candidate, scored, dtype: torch.dtype, a) -> str | None:
    """What the chosen plan does about clipping, when units update on the card, and what
    the other choice would give."""
    if not card_units(a, c):
        return None
    clip = cfg.train.grad_clip
    if dtype == torch.float16:
        return (
            "clipping: exact (fp16 loss scaling needs each step's gradient norm before any "
            "update): the card units' fp32 gradients wait on the card for it"
        )
    if clip <= 0:
        return (
            "no clipping (train.grad_clip 0): every unit updates as its backward ends, on the "
            "card or on the host"
        )
    other = "exact" if c.update == "eager" else "eager"
    rivals = [
        s for s in scored
        if s.fits_device and s.fits_host and s.candidate.update == other
        and s.candidate.card_update != "none" and s.candidate.state == c.state
        and s.candidate.disk_tier == c.disk_tier and s.candidate.tiered == c.tiered
    ]  # fmt: skip
    best = min(rivals, key=lambda s: s.prediction.step_s, default=None)
    held = sum(4 * a.units[i].n_total for i in card_units(a, c))
    if c.update == "eager":
        note = (
            f"clipping (train.grad_clip {clip}): eager (swap.update eager): each update clips "
            "by the previous step's global norm, equal to exact clipping whenever no step is "
            "clipped"
        )
        exact = (
            f"exact clipping's fastest plan: {best.prediction.tokens_per_s:,.0f} tokens/s"
            if best
            else "exact clipping keeps every card unit's fp32 gradient on the card until the "
            "step's norm is known, and no such plan fits"
        )
        return f"{note}; {exact}"
    note = (
        f"clipping (train.grad_clip {clip}): exact: the card units' fp32 gradients "
        f"({held / GiB:.1f} GiB) wait on the card for the step's global norm, then update "
        "one after another"
    )
    if best:
        rate = best.prediction.tokens_per_s
        note += f"; eager (the previous step's norm) would give {rate:,.0f} tokens/s"
    return note
