"""gpu_check section `compile`: train.compile_blocks on the device, against eager blocks.

The same swapped model trains a few steps with its blocks under torch.compile and eager,
each engine in turn in this process (the compile is per process; Inductor's disk cache
makes a second run's compile quick): whether the blocks compiled (or fell back, and why),
the seconds the first step took (the compile), the fastest later step of each, and how
far the compiled losses stray from the eager ones (bf16: a few 1e-3 is rounding).
"""

from __future__ import annotations

import logging
import time


def _run(cfg, steps: int) -> dict:
    import torch

    from atom.optim import lr_at
    from atom.run.train import build_engine
    from tools.gpu.steps import random_batches

    started = time.perf_counter()
    engine = build_engine(cfg)
    built = time.perf_counter() - started
    losses, times = [], []
    try:
        for step in range(steps + 1):
            t0 = time.perf_counter()
            losses.append(engine.train_step(random_batches(cfg, step), lr_at(step, cfg.train)).loss)
            engine.wait_idle()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return {
            "compiled": engine.blocks_compiled,
            "build_s": round(built, 1),
            "first_step_s": round(times[0], 3),
            "step_s": round(min(times[1:]), 4),
            "losses": losses,
        }
    finally:
        engine.close()


def compile_section(dry: bool) -> dict:
    from atom.config import Config

    logging.getLogger("atom.model.compiled_blocks").setLevel(logging.INFO)
    if dry:  # CPU, a tiny model: the path runs (Inductor's C++ code), not its speed
        model = {"arch": "llama", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16,
                 "vocab_size": 256}  # fmt: skip
        train = {"device": "cpu", "dtype": "fp32", "micro_batch": 2}
    else:  # a 1.3B-wide LLaMA slice: kernels of the size the 7-8B plans run
        model = {"arch": "llama", "n_layer": 8, "n_head": 16, "n_kv_head": 8, "d_model": 2048,
                 "seq_len": 2048, "vocab_size": 32000}  # fmt: skip
        train = {"device": "cuda", "dtype": "bf16", "micro_batch": 2}
    steps = 2 if dry else 4
    rows = {}
    for setting in ("off", "on"):
        cfg = Config.from_dict(
            {
                "model": model,
                "train": {**train, "compile_blocks": setting, "grad_accum": 2},
                "swap": {"layers_per_unit": 2, "prefetch": 1, "checkpoint": True},
            }
        )
        rows[setting] = _run(cfg, steps)
    eager, compiled = rows["off"], rows["on"]
    pairs = zip(compiled["losses"], eager["losses"], strict=True)
    drift = max(abs(a - b) / abs(b) for a, b in pairs)
    ok = compiled["compiled"] and drift <= (1e-4 if dry else 2e-2)
    return {
        "status": "ok" if ok else "FAILED",
        "compiled": compiled["compiled"],
        "eager_step_s": eager["step_s"],
        "compiled_step_s": compiled["step_s"],
        "eager_over_compiled": round(eager["step_s"] / compiled["step_s"], 3),
        "compile_first_step_s": compiled["first_step_s"],
        "compile_build_s": compiled["build_s"],
        "loss_rel_drift": drift,
        "rows": rows,
    }
