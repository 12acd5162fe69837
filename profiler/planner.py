"""Search the plan space and write plan.json.

Dimensions: layers_per_unit, prefetch depth, micro-batch (grad_accum makes up the target
batch), activation checkpointing, activation offload, order, the host state (swap.state)
and where it lives (RAM, or the NVMe tier: swap.disk_dir), and per unit where its weights
and its update live (resident units, swap.card_update, swap.update: placement.py). Plans must
fit the device budget and host RAM. The host state is chosen in this order, the first
that fits: fp32 in RAM (exactly plain PyTorch's training), compact in RAM (half the RAM,
not bit-equal), fp32 on disk, compact on disk (the disk tier needs a disk speed: measured
in swap.disk_dir, or stated), and last the tiered plan (tiers.py: weights, state and unit
inputs across RAM and the NVMe disk, every update on the card; the plan says what of it the
engine lacks, if anything); within it the fastest predicted plan wins, and of plans
within a few % of it the one that writes the least to the disk. `max_writes` (bytes an
hour, --max-disk-writes) rules out plans that write more. When nothing fits, `Infeasible`
says which limit fails, by how much, and what would fit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from atom.config import Config, ConfigError, model_differences, replace
from atom.profiler import tiers
from atom.profiler.analysis import ModelAnalysis, dtype_bytes
from atom.profiler.cost import Candidate, Prediction
from atom.profiler.hardware import GiB, HardwareSpec
from atom.profiler.placement import Placer

log = logging.getLogger(__name__)

# 2: swap holds SwapConfig's keys only; the NVMe tier is disk_tier. 3: placement (resident
# units in every order, swap.card_update, swap.update), with `placement` in words. 4: the
# tiered plan (`needs`: what the engine lacks to run it) and the disk's life (`disk`). 5: the
# tiered plan's bytes as the engine holds them (whole units; swap.acts_on_card), its
# candidate naming the units on the disk, disk_tier set when anything is. 6: host memory
# charged (prediction.detail.host_dram_bytes), the bf16 state, weights that stay on the card
PLAN_VERSION = 6
# plans within this share of the fastest step count as a tie that the disk's writes break
WRITE_TIE = 0.03


class Infeasible(Exception):
    """Nothing fits; the message names the failing limit, the shortfall and a way out."""


@dataclass
class Plan:
    version: int
    model: dict
    hardware: dict
    dtype: str
    target_batch: int
    swap: dict  # the swap section it means, in SwapConfig's names
    micro_batch: int
    grad_accum: int
    prediction: Prediction
    disk_tier: bool = False  # master and moments on disk: swap.disk_dir is the user's to give
    candidates: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the user should know about the choice
    # per group of units: where their weights and update live, and why (placement.describe)
    placement: list[dict] = field(default_factory=list)
    tiered: bool = False  # weights, state and unit inputs across RAM and disk (tiers.py)
    needs: list[str] = field(default_factory=list)  # what the engine lacks to run it
    # bytes written to and read from the disk a step, an hour; the drive's endurance a day
    disk: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"plan file not found: {path}; run `atom profile` first") from None
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{path} is not valid JSON ({err.msg}); run `atom profile` again"
            ) from None
        version = data.get("version") if isinstance(data, dict) else None
        if isinstance(version, int) and 0 < version < PLAN_VERSION:
            raise ConfigError(f"{path} was written by an older atom: run atom profile again")
        if version != PLAN_VERSION:
            raise ConfigError(
                f"{path} is not an atom plan (version {PLAN_VERSION}); run `atom profile` again"
            )
        try:
            data["prediction"] = Prediction(**data["prediction"])
            return cls(**data)
        except (TypeError, KeyError) as err:
            raise ConfigError(
                f"{path} is not a valid plan ({err}); run `atom profile` again"
            ) from None

    def apply(self, cfg: Config) -> Config:
        """cfg with this plan's partition and batch; refuses a plan made for another model."""
        # keys added to the model section since the plan was made take their default
        if self.needs:
            raise ConfigError(
                f"the plan needs what atom train does not run yet ({'; '.join(self.needs)}); "
                "profile again (without --tiered, with more host RAM) for a plan it runs"
            )
        said = model_differences(self.model, cfg, "in the plan")
        if said:
            raise ConfigError(
                f"the plan was made for a different model config ({said}); run `atom "
                "profile` with the same --config/--set model.* values"
            )
        swap = dict(self.swap)
        if self.disk_tier:
            swap["disk_dir"] = cfg.swap.disk_dir
            if swap["disk_dir"] is None:
                raise ConfigError(
                    "the plan keeps master weights and optimizer state on disk (NVMe tier): "
                    "give the directory with --set swap.disk_dir=DIR"
                )
        else:
            swap["disk_dir"] = None  # the plan fits in RAM: faster than any disk
        return replace(
            cfg, swap=swap, train={"micro_batch": self.micro_batch, "grad_accum": self.grad_accum}
        )


def check_replace(path: Path, cfg: Config) -> None:
    """`atom profile --out PATH` replaces a plan of the same model (profiling again is how a
    plan is refreshed) and refuses, before measuring anything, to replace a plan made for
    another model or a file that is no plan: the docs' example once overwrote ./plan.json
    of another model without a word. --force replaces it anyway."""
    if not path.exists():
        return
    try:
        data = json.loads(path.read_text())
        model = data["model"]
    except (OSError, ValueError, TypeError, KeyError):
        raise ConfigError(
            f"{path} exists and is not an atom plan; write the plan elsewhere with --out FILE, "
            "or replace the file with --force"
        ) from None
    said = model_differences(model, cfg, "in it")
    if said:
        raise ConfigError(
            f"{path} holds the plan of another model ({said}); write this one elsewhere with "
            "--out FILE, or replace it with --force"
        )


def _lpu_options(n_layer: int) -> list[int]:
    opts = [v for v in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if v <= n_layer]
    return opts or [1]


def _batch_options(target: int) -> list[int]:
    opts, b = [], 1
    while b <= target:
        if target % b == 0:
            opts.append(b)
        b *= 2
    return opts


def host_options(cfg: Config, disk_known: bool) -> list[tuple[str, bool]]:
    """(swap.state, on disk) in order of preference. A config that asks for compact or bf16
    state gets it; the default (fp32) falls back to compact when fp32 does not fit. The
    bf16 state (not bit-exact to fp32) only where asked for."""
    states = [cfg.swap.state] if cfg.swap.state != "fp32" else ["fp32", "compact"]
    return [(s, False) for s in states] + ([(s, True) for s in states] if disk_known else [])


def describe_host(state: str, disk: bool, tiered: bool = False) -> str:
    if tiered:
        return f"{state} state, tiered across RAM and the NVMe disk"
    return f"{state} state" + (" on the NVMe tier" if disk else "")


def candidates(
    cfg: Config, target_batch: int, max_prefetch: int = 3, state: str = "fp32", disk=False
):
    """The shapes of plan (placement.py places each one's units)."""
    for c in _shapes(cfg, target_batch, max_prefetch):
        yield replace_candidate(c, state=state, disk_tier=disk, update=cfg.swap.update)


def replace_candidate(c: Candidate, **changes) -> Candidate:
    return Candidate(**{**asdict(c), **changes})


def tiered_candidates(cfg: Config, target_batch: int, state: str):
    """The tiered plan's shapes (tiers.py): unit-major, inputs offloaded, every update on the
    card."""
    for c in _shapes(cfg, target_batch, 3):
        if c.order == "unit" and c.offload_activations:
            yield replace_candidate(c, state=state, tiered=True, card_update="all",
                                    update=cfg.swap.update)  # fmt: skip


def _shapes(cfg: Config, target_batch: int, max_prefetch: int):
    for lpu in _lpu_options(cfg.model.n_layer):
        n_units = 2 + -(-cfg.model.n_layer // lpu)
        for prefetch in range(0, min(max_prefetch, n_units - 1) + 1):
            for mb in _batch_options(target_batch):
                accum = target_batch // mb
                for ckpt, offload in ((False, False), (True, False), (True, True)):
                    yield Candidate(lpu, prefetch, mb, accum, ckpt, offload, "unit")
                    if accum > 1:  # micro-batch-major: one micro-batch's activations
                        yield Candidate(lpu, prefetch, mb, accum, ckpt, offload, "micro")


@dataclass
class Scored:
    candidate: Candidate
    prediction: Prediction
    fits_device: bool
    fits_host: bool
    fits_disk: bool = True  # writes under --max-disk-writes

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_disk

    @property
    def writes(self) -> float:
        """Bytes written to the disk a step."""
        return self.prediction.detail.get("disk_write_bytes", 0)

    def row(self) -> dict:
        c, p = self.candidate, self.prediction
        return {
            **asdict(c),
            "step_s": p.step_s,
            "tokens_per_s": p.tokens_per_s,
            "peak_device_bytes": p.peak_device_bytes,
            "host_bytes": p.host_bytes,
            "bottleneck": p.bottleneck,
            "disk_write_bytes": self.writes,
        }


def search(
    cfg: Config,
    hw: HardwareSpec,
    dtype: torch.dtype,
    target_batch: int,
    times_for,
    max_writes: float | None = None,
    only_tiered: bool = False,
    analyses: dict[int, ModelAnalysis] | None = None,
) -> list[Scored]:
    """Score the candidates, one host option after another (host_options, then the tiered
    plan) until one has plans that fit; `times_for(micro_batch, analysis)` gives PieceTimes;
    `max_writes`: bytes an hour the disk may be written; `only_tiered`: the tiered plan
    alone (what it would give where a plan the engine runs fits); `analyses`: the model's
    partitions (analysis()), shared by searches of one model."""
    analyses = {} if analyses is None else analyses
    scored: list[Scored] = []
    disk_known = hw.disk_read_bps > 0 and hw.disk_write_bps > 0
    options = [(s, d, False) for s, d in host_options(cfg, disk_known)]
    why_not = tiers.refused(analysis(cfg, 1, analyses), hw, cfg.train.optimizer)
    if only_tiered and why_not:
        raise Infeasible(f"no tiered plan: {why_not}")
    if not why_not:
        tiered = [(s, False, True) for s, d, _ in options if not d]
        options = tiered if only_tiered else options + tiered
    for state, disk, tiered in options:
        shapes = (tiered_candidates(cfg, target_batch, state) if tiered
                  else candidates(cfg, target_batch, state=state, disk=disk))  # fmt: skip
        group = _score(cfg, hw, dtype, shapes, times_for, analyses, max_writes)
        scored += group
        if any(s.fits for s in group):
            break
    return scored


def _score(cfg, hw, dtype, shapes, times_for, analyses, max_writes=None) -> list[Scored]:
    scored = []
    for shape in shapes:
        a = analysis(cfg, shape.layers_per_unit, analyses)
        times = times_for(shape.micro_batch, a)
        if times is None:  # that micro-batch ran out of device memory while being timed
            continue
        for cand, pred in Placer(cfg, a, hw, times, dtype).placements(shape):
            fits_device = pred.peak_device_bytes <= hw.device_mem
            s = Scored(cand, pred, fits_device, pred.host_bytes <= hw.host_mem)
            if max_writes is not None:
                s.fits_disk = s.writes * 3600 / pred.step_s <= max_writes
            scored.append(s)
    return scored


def analysis(cfg: Config, lpu: int, analyses: dict[int, ModelAnalysis] | None = None):
    """The model cut into units of `lpu` layers (cached in `analyses`)."""
    analyses = {} if analyses is None else analyses
    if lpu not in analyses:
        swap = {"layers_per_unit": lpu, "prefetch": 0, "resident_units": 0, "card_update": "none"}
        analyses[lpu] = ModelAnalysis.of(replace(cfg, swap=swap))
    return analyses[lpu]


def choose(
    scored: list[Scored],
    hw: HardwareSpec,
    cfg: Config,
    dtype: torch.dtype,
    max_writes: float | None = None,
) -> list[Scored]:
    """Feasible plans, fastest first (fewer disk writes, then fewer bus and device bytes
    break ties). Raises Infeasible."""
    ok = [s for s in scored if s.fits]
    # the host option search() stopped at (fp32 in RAM trains exactly as plain PyTorch)
    if ok:
        first = min(host_rank(s.candidate, cfg) for s in ok)
        ok = [s for s in ok if host_rank(s.candidate, cfg) == first]
        # Predictions within 1% of the fastest are a tie the model cannot resolve: among
        # those prefer the fewest bytes over the bus (copies compete with the host optimizer
        # for DRAM bandwidth, which the model charges only as a floor: on the H100 machine a
        # unit-major plan ran 1.1-1.5x faster than the micro-batch-major one it tied with),
        # weights and offloaded activations alike (an offload also pins its buffers), then
        # the smallest device footprint (headroom against fragmentation).
        fastest = min(s.prediction.step_s for s in ok)

        def rank(s: Scored) -> tuple:
            p = s.prediction
            # within WRITE_TIE of the fastest the disk's wear decides first (issue 43)
            if p.step_s > fastest * (1 + WRITE_TIE):
                return (True, 0, True, p.step_s, 0)
            if p.step_s > fastest * 1.01:
                return (False, s.writes, True, p.step_s, 0)
            bus = sum(
                p.detail.get(k, 0)
                for k in ("h2d_bytes_per_step", "offload_bytes_per_step", "state_up_bytes")
            )
            return (False, s.writes, False, bus, p.peak_device_bytes)

        return sorted(ok, key=rank)
    raise Infeasible(explain_infeasible(scored, hw, cfg, dtype, max_writes))


def host_rank(c: Candidate, cfg: Config) -> int:
    options = host_options(cfg, True)
    if c.tiered:  # after every option the engine runs
        return len(options) + options.index((c.state, False))
    return options.index((c.state, c.disk_tier))


def built_host_bytes(scored: list[Scored]) -> int | None:
    """The least host RAM a plan the engine runs needs, of those that fit the device."""
    built = [s.prediction.host_bytes for s in scored if s.fits_device and not s.candidate.tiered]
    return min(built, default=None)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def explain_infeasible(
    scored: list[Scored],
    hw: HardwareSpec,
    cfg: Config,
    dtype: torch.dtype,
    max_writes: float | None = None,
) -> str:
    fitting = [s for s in scored if s.fits_device and s.fits_host]
    if fitting and max_writes is not None:
        least = min(fitting, key=lambda s: s.writes * 3600 / s.prediction.step_s)
        hour = least.writes * 3600 / least.prediction.step_s
        return (
            f"no plan writes under --max-disk-writes {tiers.say_bytes(max_writes)} an hour to "
            f"the disk: the least any plan that fits writes is {tiers.say_bytes(hour)} an hour "
            f"({tiers.say_bytes(least.writes)} a step); allow more, or add RAM"
        )
    smallest = min(scored, key=lambda s: s.prediction.peak_device_bytes)
    leanest = min(scored, key=lambda s: s.prediction.host_bytes)
    host_need = leanest.prediction.host_bytes
    parts = []
    if host_need > hw.host_mem:
        c = leanest.candidate
        as_leanest = (
            f" even as {describe_host(c.state, c.disk_tier, c.tiered)}" if c.state != "fp32" else ""
        )
        if not c.disk_tier and hw.disk_read_bps <= 0:
            as_leanest += " (an NVMe tier may fit: --set swap.disk_dir=DIR)"
        parts.append(
            f"host RAM: the model state needs {_gib(host_need)}{as_leanest} but "
            f"{_gib(hw.host_mem)} is available (short by "
            f"{_gib(host_need - hw.host_mem)}); add RAM or choose a smaller model"
        )
    dev = smallest.prediction.peak_device_bytes
    if dev > hw.device_mem:
        c = smallest.candidate
        a = ModelAnalysis.of(
            replace(cfg, swap={"layers_per_unit": c.layers_per_unit, "prefetch": 0})
        )
        unit = a.largest_unit * dtype_bytes(dtype)
        advice = "use a smaller micro-batch" if c.micro_batch > 1 else "use a smaller model"
        fitting = _longest_fitting_seq_len(cfg, c, hw, dtype)
        if c.micro_batch == 1 and fitting:
            advice = (
                f"--set model.seq_len={fitting} would fit (activations shrink with the "
                "sequence), or use a smaller model"
            )
        parts.append(
            f"device memory: the smallest plan (micro-batch {c.micro_batch}, "
            f"{c.layers_per_unit} layer(s)/unit, prefetch {c.prefetch}, checkpointing"
            f"{' + offload' if c.offload_activations else ''}) needs {_gib(dev)} but the "
            f"budget is {_gib(hw.device_mem)} (short by {_gib(dev - hw.device_mem)}; the "
            f"largest unit is ~{_gib(unit)} of parameters); {advice}"
        )
    if not parts:  # each limit is met by some plan, but never both by the same one
        parts.append(
            "no single plan fits both the device budget and host RAM; add host RAM "
            "(activation offload needs it) or use a shorter sequence"
        )
    return "no plan fits: " + "; ".join(parts)


def state_notes(scored: list[Scored], ranked: list[Scored], hw: HardwareSpec) -> list[str]:
    """Why the chosen plan's host state is compact, and what it costs against the fastest
    fp32 plan that fits the device (which host RAM rules out)."""
    best = ranked[0].candidate
    if best.state == "fp32" and not best.disk_tier and not best.tiered:
        return []
    fp32 = [s for s in scored if s.candidate.state == "fp32" and not s.candidate.disk_tier
            and not s.candidate.tiered]  # fmt: skip
    fastest = min((s for s in fp32 if s.fits_device), key=lambda s: s.prediction.step_s,
                  default=None)  # fmt: skip
    what = {
        "compact": "fp32 weights kept as bf16 + a 16-bit remainder, 8-bit Adam moments",
        "bf16": "bf16 weights, 8-bit Adam moments, stochastic rounding: not bit-exact to fp32",
        "fp32": "fp32 weights and moments",
    }[best.state]
    p = ranked[0].prediction
    where = (
        f" and {_gib(p.detail['disk_bytes'])} on disk in swap.disk_dir, all read and written "
        f"once per step ({p.detail['disk_io_s']:.1f} s of disk time, under the updates)"
        if best.disk_tier
        else ""
    )
    if best.tiered and p.detail["disk_bytes"]:
        where = (
            f" and {_gib(p.detail['disk_bytes'])} on the NVMe disk ({p.detail['disk_io_s']:.0f}"
            f" s of disk time a step, {p.detail['disk_wait_s']:.0f} s of it not under the compute)"
        )
    note = (
        f"chose {describe_host(best.state, best.disk_tier, best.tiered)} ({what}): "
        f"{_gib(p.host_bytes)} of host RAM{where}"
    )
    if fastest is not None:
        note = (
            f"fp32 state in RAM needs {_gib(fastest.prediction.host_bytes)} and "
            f"{_gib(hw.host_mem)} is available: {note}; predicted "
            f"{p.step_s / fastest.prediction.step_s:.2f}x the step time of the fastest fp32 plan"
        )
    return [note]


def _longest_fitting_seq_len(
    cfg: Config, c: Candidate, hw: HardwareSpec, dtype: torch.dtype
) -> int | None:
    from atom.profiler.cost import peak_device_bytes

    seq = cfg.model.seq_len // 2
    while seq >= 16:
        shorter = replace(
            cfg, model={"seq_len": seq}, swap={"layers_per_unit": c.layers_per_unit, "prefetch": 0}
        )
        if (
            peak_device_bytes(ModelAnalysis.of(shorter), c, dtype, hw.device == "cuda")
            <= hw.device_mem
        ):
            return seq
        seq //= 2
    return None


def format_table(rows: list[Scored], limit: int = 8, clipped: bool = True) -> str:
    """The ranked plans as a markdown table. `clipped`: train.grad_clip > 0 (then the card
    update column says exact or eager)."""
    head = (
        "| # | layers/unit | prefetch | micro-batch x accum | order | resident | card update | "
        "checkpoint | offload | host state | step s | tokens/s | device peak | host RAM | "
        "bottleneck |"
    )
    writes = any(s.writes for s in rows[:limit])  # a column only where some plan writes
    if writes:
        head += " disk writes |"
    lines = [head, "|" + "---|" * (15 + writes)]
    for i, s in enumerate(rows[:limit], 1):
        c, p = s.candidate, s.prediction
        card = c.card_update
        if card != "none" and clipped:
            card += f" ({c.update})"
        offload = "yes" if c.offload_activations else "no"
        if c.offload_activations and c.acts_on_card:
            offload = f"all but {c.acts_on_card}"
        where = " (tiered)" if c.tiered else " (disk)" if c.disk_tier else ""
        lines.append(
            f"| {i} | {c.layers_per_unit} | {c.prefetch} | {c.micro_batch} x {c.grad_accum} | "
            f"{c.order if c.grad_accum > 1 else '-'} | {c.resident_units} | {card} | "
            f"{'yes' if c.checkpoint else 'no'} | {offload} | "
            f"{c.state}{where} | {p.step_s:.3f} | "
            f"{p.tokens_per_s:,.0f} | "
            f"{_gib(p.peak_device_bytes)} | "
            f"{_gib(p.host_bytes)} | {p.bottleneck} |"
            + (f" {s.writes / 1e9:,.1f} GB |" if writes else "")
        )
    return "\n".join(lines)


def make_plan(
    cfg: Config,
    hw: HardwareSpec,
    dtype: torch.dtype,
    target_batch: int,
    ranked: list[Scored],
    tbw: float = tiers.DEFAULT_TBW,
) -> Plan:
    best = ranked[0]
    c = best.candidate
    return Plan(
        version=PLAN_VERSION,
        model=cfg.to_dict()["model"],
        hardware=hw.to_dict(),
        dtype=str(dtype).replace("torch.", ""),
        target_batch=target_batch,
        swap=c.swap_settings(),
        micro_batch=c.micro_batch,
        grad_accum=c.grad_accum,
        prediction=best.prediction,
        disk_tier=c.disk_tier or bool(best.prediction.detail.get("disk_bytes")),
        candidates=[s.row() for s in ranked[:20]],
        tiered=c.tiered,
        needs=tiers.needs(c, best.prediction),
        disk=tiers.disk_life(best.prediction, tbw),
    )
