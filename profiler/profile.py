"""`atom profile`: analyse the model, measure (or take as stated) the machine, search the
plans, and return the ranked plans. The CLI prints the table and writes plan.json."""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from atom.config import Config, ConfigError, replace
from atom.ground.device import DTYPES
from atom.model.compiled_blocks import wanted
from atom.optim.compact import CHUNK
from atom.profiler import hardware, tiers, timing
from atom.profiler.analysis import ModelAnalysis
from atom.profiler.placement import clipping_note, describe
from atom.profiler.planner import (
    Infeasible,
    Plan,
    Scored,
    analysis,
    built_host_bytes,
    choose,
    make_plan,
    search,
    state_notes,
)

log = logging.getLogger(__name__)


def stated_dtype(hw: hardware.HardwareSpec, cfg: Config) -> torch.dtype:
    if cfg.train.dtype != "auto":
        return DTYPES[cfg.train.dtype]
    if hw.dtype != "auto":
        return DTYPES[hw.dtype]
    return torch.bfloat16 if hw.device == "cuda" else torch.float32


def cached_hardware(
    cfg: Config,
    device: torch.device,
    dtype: torch.dtype,
    cache: timing.TimingCache,
    refresh: bool = False,
    disk_dir: str | None = None,
    progress: bool = False,
) -> hardware.HardwareSpec:
    """This machine as measured (at the transfer size of one layer's unit): from the
    profile cache, else measured now and cached (`atom profile`, `atom simulate
    --hardware measured`)."""
    if cache.data.get("hardware") and not refresh:
        hw = hardware.HardwareSpec.from_dict(cache.data["hardware"])
        if disk_dir is not None and not hw.disk_read_bps:
            hw.disk_read_bps, hw.disk_write_bps = hardware.measure_disk(disk_dir)
            cache.data["hardware"] = hw.to_dict()
        if hw.device == "cuda" and not hw.card_mem_bps:  # cached before it was measured
            hw.card_mem_bps = hardware.measure_card_memory(device)
            cache.data["hardware"] = hw.to_dict()
        if not hw.host_mem_bps:  # cached before host memory was charged (issue 49)
            hw.host_mem_bps = hardware.measure_host_memory()
            cache.data["hardware"] = hw.to_dict()
        if hw.device == "cuda" and not hw.duplex_d2h_bps:  # before both ways were timed
            hw.duplex_h2d_bps, hw.duplex_d2h_bps = hardware.measure_duplex(
                device, 1 << 25, torch.bfloat16
            )
            cache.data["hardware"] = hw.to_dict()
        return hw
    one_layer = replace(cfg, swap={"layers_per_unit": 1, "prefetch": 0})
    largest = ModelAnalysis.of(one_layer).largest_unit
    # the compact update is compiled for whole chunks only: a model whose units are all
    # smaller updates eagerly, and is measured so (without compiling)
    compiled = cfg.swap.compile_update and largest >= CHUNK
    hw = hardware.measure(device, largest, dtype, None, None, disk_dir, progress, compiled)
    cache.data["hardware"] = hw.to_dict()
    return hw


def run_profile(
    cfg: Config,
    target_batch: int | None = None,
    gpu_mem: int | None = None,
    host_mem: int | None = None,
    stated: str | None = None,
    refresh: bool = False,
    progress: bool = True,
    nvme_tbw: float = tiers.DEFAULT_TBW,
    max_disk_writes: float | None = None,
    only_tiered: bool = False,
    rivals: bool = True,
) -> tuple[Plan, list[Scored], hardware.HardwareSpec]:
    """`nvme_tbw`: the drive's rated endurance, TB written; `max_disk_writes`: bytes an hour
    a plan may write to the disk (None: any); `only_tiered`: the tiered plan (tiers.py) even
    where a plan the engine runs fits; `rivals`: the notes on what another state would give
    (a second search: tools/hardware_table, which prints no notes, leaves it out)."""
    target = target_batch or cfg.train.micro_batch * cfg.train.grad_accum
    if target < 1:
        raise ConfigError("--batch must be >= 1")
    if stated is not None:
        hw = hardware.stated(stated, gpu_mem, host_mem)
        dtype = stated_dtype(hw, cfg)
        if hw.matmul_flops <= 0:
            raise ConfigError(
                "a stated hardware spec needs matmul_flops > 0 to estimate compute time"
            )

        def times_for(mb: int, a: ModelAnalysis):
            return timing.estimate_pieces(a, mb, hw)
    else:
        from atom.ground.device import resolve_device

        device, dtype = resolve_device(cfg)
        cache = timing.TimingCache(timing.cache_key(cfg, device, dtype), refresh)
        disk_dir = cfg.swap.disk_dir
        hw = cached_hardware(cfg, device, dtype, cache, refresh, disk_dir, progress)
        if gpu_mem is not None:
            hw.device_mem = gpu_mem
        if host_mem is not None:
            hw.host_mem = host_mem
            if gpu_mem is None and hw.device == "cpu":  # the "device" shares that RAM
                hw.device_mem = host_mem // 2
        if disk_dir is None:  # a disk measured for another run's directory is not this one's
            hw.disk_read_bps = hw.disk_write_bps = 0.0
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= target]
        too_big = cache.data.get("oom_from")
        missing = [
            b
            for b in sizes
            if target % b == 0 and cache.pieces(b) is None and (too_big is None or b < too_big)
        ]
        clock = timing.MeasureClock(ModelAnalysis.of(cfg), device, dtype) if missing else None
        if missing:
            log.info(
                "timing one block at micro-batch %s: %s in all (measured once, cached)",
                ", ".join(map(str, missing)), timing.say_seconds(clock.total(missing)),
            )  # fmt: skip
        bar = tqdm(missing, desc="timing one block", unit="batch size",
                   disable=not progress or not missing)  # fmt: skip
        compiled = wanted(cfg.train.compile_blocks, device)
        first_pass = time.perf_counter()
        for mb in bar:
            ahead = f"micro-batch {mb}: {timing.say_seconds(clock.seconds(mb))}"
            bar.set_postfix_str(ahead)
            if not progress:  # not a terminal: a log line per measurement instead
                log.info("timing one block at %s", ahead)
            try:
                started = time.perf_counter()
                cache.put_pieces(mb, timing.measure_pieces(cfg.model, mb, device, dtype))
                clock.measured(mb, time.perf_counter() - started)
            except torch.cuda.OutOfMemoryError:
                # One block (or the head's B x T x V logits) at this micro-batch does not
                # fit the device: no plan can use it or anything larger. Back off.
                log.warning(
                    "micro-batch %d does not fit on the device even for one block; "
                    "plans use smaller ones",
                    mb,
                )
                cache.data["oom_from"] = mb
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                break
        timed = [b for b in missing if cache.pieces(b) is not None]
        for _ in range(timing.extra_passes(time.perf_counter() - first_pass) if timed else 0):
            for mb in timed:
                again = timing.measure_pieces(cfg.model, mb, device, dtype)
                cache.put_pieces(mb, timing.fastest(cache.pieces(mb), again))
        # every size is timed eagerly (and cached whatever the setting); one, compiled,
        # gives the ratio train.compile_blocks applies to them all
        known = [b for b in sizes if cache.pieces(b) is not None]
        if compiled and known and "compiled_factor" not in cache.data:
            log.info("timing one compiled block at micro-batch %d (compiles once)", known[-1])
            cache.data["compiled_factor"] = timing.compiled_factor(
                cfg.model, known[-1], device, dtype, cache.pieces(known[-1])
            )
        factor = cache.data.get("compiled_factor", 1.0) if compiled else 1.0
        cache.save()

        def times_for(mb: int, a: ModelAnalysis):
            t = cache.pieces(mb)  # None: not measurable here (out of memory)
            return t and timing.blocks_scaled(t, factor)

    analyses: dict = {}  # the model's partitions, for the searches below
    scored = search(cfg, hw, dtype, target, times_for, max_disk_writes, only_tiered, analyses)
    ranked = choose(scored, hw, cfg, dtype, max_disk_writes)
    plan = make_plan(cfg, hw, dtype, target, ranked, nvme_tbw)
    best = ranked[0].candidate
    a = analysis(cfg, best.layers_per_unit)
    notes = []
    if best.tiered:
        notes += tiers.describe(best, ranked[0].prediction)
    else:
        plan.placement = describe(cfg, a, best, hw, times_for(best.micro_batch, a), dtype)
    clipping = clipping_note(cfg, best, scored, dtype, a)
    notes += state_notes(scored, ranked, hw) + ([clipping] if clipping else [])
    notes += [bus_note(hw)] + host_memory_note(ranked[0].prediction, hw)
    if rivals:
        notes += _bf16_rival(cfg, hw, dtype, target, times_for, max_disk_writes, analyses)
    disk = tiers.disk_note(plan.disk)
    notes += [disk] if disk else []
    if disk and not best.tiered:  # what the tiered plan would cost the disk instead
        notes += _tiered_rival(cfg, hw, dtype, target, times_for, ranked[0], max_disk_writes)
    if plan.needs:  # last: the line a user must not miss
        notes.append(tiers.needs_note(plan.needs, built_host_bytes(scored), not only_tiered))
    plan.notes = notes
    return plan, ranked, hw


def _tiered_rival(cfg, hw, dtype, target, times_for, best: Scored, max_writes) -> list[str]:
    """A line on the tiered plan where it would write less than the chosen plan, or run
    faster (and whether the engine runs it yet)."""
    try:
        rival = choose(search(cfg, hw, dtype, target, times_for, max_writes, True), hw, cfg,
                       dtype, max_writes)[0]  # fmt: skip
    except Infeasible:
        return []
    p, q = best.prediction, rival.prediction
    if rival.writes >= best.writes and q.step_s >= p.step_s:
        return []
    built = "" if tiers.needs(rival.candidate, q) else "; atom trains it"
    return [
        f"a tiered plan ({'not built yet: ' * (not built)}`atom profile --tiered` shows it"
        f"{built}) would write "
        f"{tiers.say_bytes(rival.writes)} a step at {q.tokens_per_s:,.0f} tokens/s, against "
        f"{tiers.say_bytes(best.writes)} at {p.tokens_per_s:,.0f}"
    ]


def bus_note(hw: hardware.HardwareSpec) -> str:
    """The link's rates, one way and both ways at once, and where they come from."""
    source = hw.rates_source or ("measured here" if hw.measured else "as the spec gives them")
    return (
        f"bus: {hw.h2d_bps / 1e9:.1f} GB/s up, {hw.d2h_bps / 1e9:.1f} down; both ways at once "
        f"{hw.duplex_h2d_bps / 1e9:.1f} up while {hw.duplex_down_bps / 1e9:.1f} down ({source})"
    )


def host_memory_note(p, hw: hardware.HardwareSpec) -> list[str]:
    """What the step moves through host DRAM, and whether that binds it (cost.predict's
    host_dram); none where the host's memory bandwidth is not charged."""
    d = p.detail
    if not d.get("host_dram_s"):
        return []
    parts = {
        "DMA": ("weights_up", "grads_down", "offload"),
        "gradient landings": ("grad_landing",),
        "host updates": ("host_update",),
        "the card update's state (up, down, landed)": ("card_state",),
        "the disk": ("disk",),
    }
    said = [
        f"{name} {total / 1e9:.1f}"
        for name, keys in parts.items()
        if (total := sum(d["host_dram"].get(k, 0) for k in keys))
    ]
    floor, pipeline = d["host_dram_s"], d["pipeline_s"]
    verdict = (
        f"host memory binds: a step takes {floor:.2f} s at that, {pipeline:.2f} s without it"
        if floor >= pipeline
        else f"under the step's other limits ({pipeline:.2f} s): it does not bind"
    )
    return [
        f"host memory: {d['host_dram_bytes'] / 1e9:.1f} GB through host DRAM a step "
        f"({', '.join(said)} GB) at {hw.host_mem_bps / 1e9:.0f} GB/s is {floor:.2f} s; " + verdict
    ]


def _bf16_rival(cfg, hw, dtype, target, times_for, max_writes, analyses) -> list[str]:
    """Where the user did not choose the bf16 state: what it would give, in one line."""
    if cfg.swap.state == "bf16" or cfg.train.optimizer != "adamw":
        return []  # chosen already, or an optimizer of the user's the bf16 state replaces
    light = replace(cfg, swap={"state": "bf16"})
    try:
        found = search(light, hw, dtype, target, times_for, max_writes, analyses=analyses)
        best = choose(found, hw, light, dtype, max_writes)[0]
    except Infeasible:
        return []
    p = best.prediction
    built = "; not built yet" if tiers.needs(best.candidate, p) else ""
    return [
        f"the bf16 state (swap.state=bf16, lighter, not bit-exact to fp32{built}) would give "
        f"{p.tokens_per_s:,.0f} tokens/s in {p.host_bytes / hardware.GiB:.1f} GiB of RAM"
    ]
