"""Timed training steps for tools/gpu_check: the shared step timer, and the child process
that trains `atom profile`'s plan for a model that does not fit the device cap, then the
same engine under each schedule (unit- or micro-batch-major, exact or eager updates).

    python3 -m tools.gpu_check OUT            # runs this as a child; not meant by hand
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path


def random_batches(cfg, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(cfg.train.grad_accum):
        x = torch.randint(
            0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len), generator=g
        )
        out.append((x, torch.roll(x, -1, 1)))
    return out


def time_steps(engine, cfg, steps: int, warmup: int = 1) -> list[float]:
    from atom.optim import lr_at

    times = []
    for step in range(warmup + steps):
        batches = random_batches(cfg, step)
        t0 = time.perf_counter()
        engine.train_step(batches, lr_at(step, cfg.train))
        if step < warmup:
            engine.wait_idle()
        elif step == warmup + steps - 1:
            engine.wait_idle()  # the last step pays for the optimizer work still queued
        _sync(cfg)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _sync(cfg) -> None:
    import torch

    if cfg.train.device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def train_child(
    plan_path: str, config: str, gpu_mem: str, steps: int, dry: bool, sets: list[str]
) -> None:
    """Train the plan's steps under the memory cap; write big_train.json."""
    import torch

    from atom.config import load_config
    from atom.ground.sizes import parse_bytes
    from atom.profiler.planner import Plan
    from atom.run.train import build_engine

    out = Path(os.environ["GPU_CHECK_OUT"])
    cfg = load_config(config, [s for s in sets if s != "--set"])
    plan = Plan.load(Path(plan_path))
    cfg = plan.apply(cfg)
    if dry:
        cfg.train.device = "cpu"
    cap = parse_bytes(gpu_mem)
    if not dry:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    build_s = time.perf_counter() - t0
    if not dry:
        torch.cuda.reset_peak_memory_stats()
    res = {
        "plan": {"swap": plan.swap, "micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum},
        "predicted": plan.prediction.to_dict(),
        "build_s": round(build_s, 1),
    }
    backend = engine.backend
    backend.time_copies = not dry  # CUDA events around each H2D copy
    result_file = out / "big_train.json"

    def write() -> None:  # as each result exists: a budget kill must not lose them
        tmp = result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2))
        tmp.replace(result_file)

    write()
    try:
        loads0 = engine.slots.bytes_loaded
        times = time_steps(engine, cfg, steps)
        copy_gbps = backend.copy_gbps() if not dry else None
        backend.time_copies = False
        step_s = statistics.median(times)
        moved = (engine.slots.bytes_loaded - loads0) / (len(times) + 1)
        tokens = cfg.train.micro_batch * cfg.train.grad_accum * cfg.model.seq_len
        hw = plan.hardware
        bus_floor = moved / hw["h2d_bps"] if hw.get("h2d_bps") else None
        compute = plan.prediction.detail["compute_s"]
        peak = engine.device_peak_bytes()
        dt = torch.empty(0, dtype=engine.dtype).element_size()
        bus_buffers = sum(u.n_total for u in engine.units) * dt
        staging = 3 * max(u.n_total for u in engine.units) * 4
        pinned = getattr(engine.backend, "pinned_bytes", 0)
        res.update(
            pinned_bytes=pinned,
            pinned_over_buffers=round(pinned / (bus_buffers + staging), 4) if pinned else None,
            schedule=f"{cfg.swap.order}-major, {cfg.swap.update} updates",
            step_times_s=[round(t, 3) for t in times],
            step_s=round(step_s, 3),
            tokens_per_s=round(tokens / step_s, 1),
            h2d_bytes_per_step=moved,
            bus_floor_s=bus_floor,
            compute_s_predicted=compute,
            step_over_floor=round(step_s / max(compute, bus_floor or 0.0), 3),
            h2d_achieved_gbps=round(moved / step_s / 1e9, 2),  # over the whole step
            h2d_copy_gbps=round(copy_gbps, 2) if copy_gbps else None,  # while copying
            device_peak_bytes=peak,
            peak_over_predicted=round(peak / plan.prediction.peak_device_bytes, 3),
            step_over_predicted=round(step_s / plan.prediction.step_s, 3),
        )
        write()
        res["variants"] = []
        _schedule_variants(engine, cfg, steps, dry, res["variants"], write, step_s)
    finally:
        write()
        engine.close()


def _schedule_variants(
    engine, cfg, steps: int, dry: bool, rows: list, write, step_s: float
) -> None:
    """The same engine at a larger batch (grad_accum making it up), with each schedule:
    unit- or micro-batch-major order, exact or eager updates. Each row is written as it
    exists; a variant the time budget cannot fit is skipped with a line saying so."""
    import torch

    from tools.gpu.proc import seconds_left

    target = 16 if dry else 32
    accum = max(1, target // cfg.train.micro_batch)
    scale = accum / max(1, cfg.train.grad_accum)
    cfg.train.grad_accum = accum
    tokens = cfg.train.micro_batch * accum * cfg.model.seq_len
    n_steps = max(2, steps - 1)
    for order, update in (("unit", "exact"), ("unit", "eager"), ("micro", "exact")):
        need = (n_steps + 2) * step_s * scale * 1.5 + 10  # warm-up, timed steps, margin
        if seconds_left() < need:
            rows.append({"order": order, "update": update,
                         "skipped": f"out of the time budget ({seconds_left():.0f} s left, "
                                    f"needs ~{need:.0f} s)"})  # fmt: skip
            write()
            continue
        engine.set_schedule(order=order, update=update)
        if not dry:
            torch.cuda.reset_peak_memory_stats()
        h2d0, d2h0 = engine.slots.bytes_loaded, engine.d2h_bytes
        try:
            times = time_steps(engine, cfg, n_steps)
        except torch.cuda.OutOfMemoryError as err:
            rows.append({"order": order, "update": update, "error": f"OOM: {err}"[:200]})
            write()
            continue
        n = len(times) + 1
        step_s, scale = statistics.median(times), 1.0  # measured at this batch: no scaling
        rows.append(
            {
                "order": order,
                "update": update,
                "micro_batch": cfg.train.micro_batch,
                "grad_accum": accum,
                "step_s": round(step_s, 3),
                "tokens_per_s": round(tokens / step_s, 1),
                "h2d_gb_per_step": round((engine.slots.bytes_loaded - h2d0) / n / 1e9, 2),
                "d2h_gb_per_step": round((engine.d2h_bytes - d2h0) / n / 1e9, 2),
                "device_peak_gib": round(engine.device_peak_bytes() / 2**30, 2),
            }
        )
        write()
