"""Per-block compute time at candidate micro-batch sizes: measured by running one real
block (and the head and embedding) with random weights on the device, or estimated from
FLOPs for stated hardware. Measurements are cached per machine and model as JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

import torch

from atom.config import Config, ModelConfig
from atom.model import build_model, materialize
from atom.model.compiled_blocks import compile_blocks
from atom.model.head_loss import head_loss
from atom.profiler.analysis import ModelAnalysis
from atom.profiler.hardware import HardwareSpec
from atom.swap.malloc import keep_freed_blocks

log = logging.getLogger(__name__)

# Bumped when a cached measurement changes meaning, so caches of the old kind are measured
# again: 2 = unit overhead as the residual beyond the piece times (hardware.py).
HARDWARE_MODEL = 2


@dataclass
class PieceTimes:
    """Seconds for one micro-batch of size B."""

    block_fwd: float  # one block forward (no grad): also the recompute cost
    block_bwd: float  # one block backward, given its saved activations
    head: float  # head forward + loss + backward
    embed: float  # embedding forward + backward


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device, reps: int, window_s: float = 0.25, max_reps: int = 50) -> float:
    """Fastest of at least `reps` runs after a warm-up: on a shared machine other processes
    only ever add time, so the minimum is the least noisy estimate of the cost itself.
    Short pieces run until `window_s` has passed (at most `max_reps` runs): five runs of
    a few milliseconds fit inside one burst of another process's work, and a small
    model's piece times came out 20-40% high in some sweeps and not in others."""
    fn()  # warm-up: allocator, kernels, caches
    _sync(device)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < reps or (len(times) < max_reps and time.perf_counter() - started < window_s):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_pieces(
    model_cfg: ModelConfig,
    micro_batch: int,
    device: torch.device,
    dtype: torch.dtype,
    reps: int = 5,
    compiled: bool = False,
) -> PieceTimes:
    """`compiled`: the block under torch.compile, as train.compile_blocks will run it (when
    it does not compile: eager, as training would fall back)."""
    if device.type == "cpu":
        # the CPU backend's malloc policy (atom/swap/malloc.py), as the step will run under
        # it: without it every backward page-faults its gradients in afresh, and piece times
        # taken before any engine existed (cached hardware) came out 10-25% high
        keep_freed_blocks()
    one = ModelConfig(**{**asdict(model_cfg), "n_layer": 1})
    model = materialize(build_model(one), seed=0, device=device, dtype=dtype)
    B, T, d = micro_batch, one.seq_len, one.d_model
    x = torch.randn(B, T, d, device=device, dtype=dtype, requires_grad=True)
    tokens = torch.randint(0, one.vocab_size, (B, T), device=device)
    block, head, embed = model.blocks[0], model.head, model.embed
    if compiled:
        compile_blocks([block], x.detach())

    def fwd() -> None:
        with torch.no_grad():
            block(x)

    def fwd_bwd() -> None:
        block(x).sum().backward()

    def head_step() -> None:
        head_loss(head, x, tokens).backward()  # as the engines' head: logits in chunks

    def embed_step() -> None:
        embed(tokens).sum().backward()

    t_fwd = _best(fwd, device, reps)
    t_both = _best(fwd_bwd, device, reps)
    return PieceTimes(
        block_fwd=t_fwd,
        block_bwd=max(t_both - t_fwd, 0.0),
        head=_best(head_step, device, reps),
        embed=_best(embed_step, device, reps),
    )


# A small model's piece times come from a few milliseconds of running each size: a slow
# moment of a shared machine inflates one micro-batch size and not the others, and plans
# of that size lose a ranking they should win (a CPU sweep chose a plan 1.29x the best
# from one such pass, with micro-batch 2 timed 30% high). While a pass is this cheap, the
# sizes are timed again in turn, and each piece keeps its fastest.
MAX_PASSES = 3
REPEAT_BELOW_S = 20.0  # seconds all passes together may take


def fastest(a: PieceTimes, b: PieceTimes) -> PieceTimes:
    return PieceTimes(*(min(x, y) for x, y in zip(astuple(a), astuple(b), strict=True)))


def compiled_factor(
    model_cfg: ModelConfig, micro_batch: int, device: torch.device, dtype: torch.dtype,
    eager: PieceTimes,
) -> float:  # fmt: skip
    """What train.compile_blocks makes of a block's time: compiled over eager forward and
    backward at one micro-batch. The other sizes are timed eagerly and scaled by it, so that
    `atom profile` compiles once (a minute for an 8B block), not once per size."""
    try:
        c = measure_pieces(model_cfg, micro_batch, device, dtype, compiled=True)
    except torch.cuda.OutOfMemoryError:  # Inductor's buffers at the largest size: no gain
        return 1.0
    return (c.block_fwd + c.block_bwd) / max(eager.block_fwd + eager.block_bwd, 1e-12)


def blocks_scaled(t: PieceTimes, factor: float) -> PieceTimes:
    return PieceTimes(t.block_fwd * factor, t.block_bwd * factor, t.head, t.embed)


def extra_passes(first_pass_s: float) -> int:
    """Passes to add after the first, which took `first_pass_s`."""
    return MAX_PASSES - 1 if first_pass_s * MAX_PASSES <= REPEAT_BELOW_S else 0


class MeasureClock:
    """How long `measure_pieces` will take at a micro-batch, said before it starts (a
    2.7B model's block took 90 s at micro-batch 1 on a CPU, in silence): first from a
    matmul's rate on this device, then from the measurements so far (the work grows with
    the batch)."""

    def __init__(self, analysis: ModelAnalysis, device: torch.device, dtype: torch.dtype,
                 reps: int = 5):  # fmt: skip
        flops, seq_len = analysis.flops_per_token(), analysis.cfg.model.seq_len
        # a warm-up and `reps` runs each of: the block forward (1x), forward and backward
        # (3x), the head's step (3x)
        self.flops_per_sample = (1 + reps) * seq_len * (4 * flops["block"] + 3 * flops["head"])
        self.rate = matmul_rate(device, dtype)

    def seconds(self, micro_batch: int) -> float:
        return self.flops_per_sample * micro_batch / self.rate

    def measured(self, micro_batch: int, seconds: float) -> None:
        self.rate = self.flops_per_sample * micro_batch / max(seconds, 1e-9)

    def total(self, micro_batches: list[int]) -> float:
        """All of them, with the passes a cheap first pass is repeated (extra_passes): a
        tiny model's timing was said to take "about 0 s in all" and took seconds."""
        first = sum(map(self.seconds, micro_batches))
        return first * (1 + extra_passes(first))


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 512) -> float:
    """FLOP/s of an n x n matmul here (the best of three): a floor for what a block gets."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / max(_best(lambda: a @ a, device, 3), 1e-9)


def say_seconds(s: float) -> str:
    """An estimate in words. Below 10 s, no figure: a small model's pieces take what the
    interpreter and the kernel launches take, which FLOPs do not predict (a tiny block
    estimated at 0.01 s took 0.14 s)."""
    if s < 10:
        return "under 10 s"
    return f"about {s:.0f} s" if s < 90 else f"about {s / 60:.0f} min"


def estimate_pieces(analysis: ModelAnalysis, micro_batch: int, hw: HardwareSpec) -> PieceTimes:
    """From FLOPs and the stated throughput: backward costs two forwards."""
    tokens = micro_batch * analysis.cfg.model.seq_len
    flops = analysis.flops_per_token()
    fwd = flops["block"] * tokens / hw.matmul_flops
    head = 3 * flops["head"] * tokens / hw.matmul_flops
    return PieceTimes(block_fwd=fwd, block_bwd=2 * fwd, head=head, embed=0.0)


def _cache_dir() -> Path:
    root = Path(os.environ.get("ATOM_CACHE", Path.home() / ".cache" / "atom"))
    return root / "profile"


def cache_key(cfg: Config, device: torch.device, dtype: torch.dtype) -> str:
    model = {k: v for k, v in asdict(cfg.model).items() if k != "n_layer"}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    machine = [
        platform.node(),
        platform.processor(),
        platform.machine(),
        os.cpu_count(),
        gpu,
        torch.__version__,
        cfg.swap.compile_update,  # the compact update's measured rate depends on it
        HARDWARE_MODEL,  # what the cached measurements mean
    ]
    blob = json.dumps([model, machine, str(dtype)], sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


class TimingCache:
    """{micro_batch: PieceTimes} and the measured hardware, in one JSON file per key."""

    def __init__(self, key: str, refresh: bool = False):
        self.path = _cache_dir() / f"{key}.json"
        self.data: dict = {"pieces": {}, "hardware": None}
        if self.path.exists() and not refresh:
            try:
                self.data = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError):
                log.warning("ignoring unreadable profile cache %s", self.path)

    def pieces(self, micro_batch: int) -> PieceTimes | None:
        raw = self.data["pieces"].get(str(micro_batch))
        return PieceTimes(**raw) if raw else None

    def put_pieces(self, micro_batch: int, times: PieceTimes) -> None:
        self.data["pieces"][str(micro_batch)] = asdict(times)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def scaled_times(table: dict[int, PieceTimes]) -> Callable[[int], PieceTimes]:
    """Piece times for any micro-batch from the nearest measured one, scaled by size."""

    def times(mb: int) -> PieceTimes:
        if mb in table:
            return table[mb]
        near = min(table, key=lambda b: abs(b - mb))
        t, r = table[near], mb / near
        return PieceTimes(t.block_fwd * r, t.block_bwd * r, t.head * r, t.embed * r)

    return times
