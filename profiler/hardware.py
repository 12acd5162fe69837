"""The machine: memory, host<->device bandwidth, host optimizer speed.

Either measured here (CPU backend or CUDA), or stated: a preset name or a JSON file for a
machine you do not have at hand (`atom profile --hardware rtx4090 --host-mem 128GiB`), in
which case block times are estimated from FLOPs and the stated throughput.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import psutil
import torch

from atom.config import ConfigError
from atom.ground.sizes import parse_bytes as parse_bytes  # re-exported: atom/cli/, tools/
from atom.profiler.bandwidth import (  # re-exported: profile.py, tests
    copy_bps,
    measure_card_memory,
    measure_disk,
    measure_duplex,
    measure_host_memory,
    one_way,
)
from atom.profiler.bandwidth import median_time as _median_time

log = logging.getLogger(__name__)

GiB = 2**30
# One core's time for a compact unit update, ns per parameter: the compiled update
# (swap.compile_update, the default) measured on this project's 2-core x86 VM, one thread,
# quiet (load 1.0), 2026-12-07: 6.30 (fastest 5.92), 3.00x torch's fused fp32 update
# beside it (`python -m tools.bench.host_update --threads 1 --rounds 3`, docs/benchmarks.md;
# since its loops hold no int16, issue 49). It was 3.4 until then, derived from the eager
# figure over a speed-up measured before the remainder state: 2.6x optimistic against the
# code of the time. Presets assume 4 cores' worth: a desktop's 8 at the scaling measured
# here (2 threads ran 1.4-1.5x faster than one).
COMPACT_NS_PER_CORE = 6.3
COMPACT_PRESET_CORES = 4


@dataclass
class HardwareSpec:
    name: str
    device: str  # cuda | cpu
    device_mem: int  # bytes the plan may use on the device
    host_mem: int  # bytes of host RAM available for model state
    h2d_bps: float  # host->device, pinned, large transfers
    d2h_bps: float
    duplex_h2d_bps: float  # H2D while D2H also runs (shared bus)
    matmul_flops: float  # effective FLOP/s of the compute dtype (stated specs only)
    adam_s_per_param: float  # host optimizer step, seconds per parameter
    accum_s_per_param: float  # host gradient accumulation (one add), seconds per parameter
    host_shares_compute: bool  # CPU backend: host work competes with compute for cores
    measured: bool = False
    dtype: str = "auto"  # compute dtype: auto = bf16 on CUDA, fp32 on CPU; fp16 for pre-Ampere
    unit_overhead_s: float = 2e-4  # Python + launch cost of one unit visit
    # host-side Python of one unit's update beyond its per-parameter cost (measured only)
    unit_update_overhead_s: float = 0.0
    # swap.state=compact: one unit update (decode, AdamW, remainder split, encode), seconds per
    # parameter; compute-bound on the host's cores rather than DRAM-bound (see PRESETS)
    compact_adam_s_per_param: float = COMPACT_NS_PER_CORE * 1e-9 / COMPACT_PRESET_CORES
    # the NVMe tier's disk (swap.disk_dir), large sequential transfers; 0: none known
    disk_read_bps: float = 0.0
    disk_write_bps: float = 0.0
    # the card's memory bandwidth, bytes/s: the update on the card (swap.card_update) is
    # memory-bound there; 0: unknown (a CPU machine, whose "card" is host memory, prices
    # that update at the host update's rates; a CUDA spec without it plans no card update)
    card_mem_bps: float = 0.0
    # D2H while H2D also runs, bytes/s; 0: as d2h_bps (a spec written before it was kept)
    duplex_d2h_bps: float = 0.0
    # host memory (DRAM) bandwidth, bytes/s: every byte of a step's DMA, landing copies,
    # host updates and disk transfers passes through it (cost.host_dram_bytes), and a step
    # can not be shorter than their sum over it; 0: unknown, not charged
    host_mem_bps: float = 0.0
    # where the rates come from, in words (the profile's notes say it)
    rates_source: str = ""

    @property
    def duplex_down_bps(self) -> float:
        """D2H while H2D also runs."""
        return self.duplex_d2h_bps or self.d2h_bps

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HardwareSpec:
        names = {f.name for f in fields(cls)}
        optional = {
            "measured",
            "dtype",
            "unit_overhead_s",
            "unit_update_overhead_s",
            "compact_adam_s_per_param",
            "disk_read_bps",
            "disk_write_bps",
            "card_mem_bps",
            "duplex_d2h_bps",
            "host_mem_bps",
            "rates_source",
        }
        missing = names - set(data) - optional
        if missing:
            raise ConfigError(f"hardware spec is missing {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


# The share of a card's measured dense matmul rate that a training step's blocks get
# (attention, norms, activations and launches around the matmuls). From the one published
# full fine-tune on a consumer card: torchtune's Llama 3.1 8B on an RTX 4090, 1,650
# tokens/s with activation checkpointing (its README; FIELD_NOTES.md), is 1,650 x (8 x
# 8.03e9 + attention) ~ 110 TFLOP/s of hardware FLOPs, 0.65 of the card's 170 measured
# below. Under torch.compile; atom's eager blocks may get less (issue 27: measure).
TRAINING_SHARE_OF_MATMUL = 0.65


# Host memory bandwidth of the desktop every consumer preset assumes, two channels of DDR5,
# GB/s: AIDA64's memory benchmark on a Ryzen 7 9800X3D with DDR5-6000 reads 62 and copies
# 59 (tomshardware forum thread 3871519), of a theoretical 96 (2 channels x 8 bytes x 6000
# MT/s); a step's mix of DMA, copies and updates gets at best about that. A DDR4 desktop
# measures about half (STREAM triad 27 GB/s on a Ryzen 9 5900X, noonghunna/club-3090 issue
# 1095): give such a machine as a JSON spec with its own host_mem_bps.
DESKTOP_DDR5_GBPS = 60
# D2H while H2D also runs, as a share of D2H alone: 24 GB/s against 25-26 on A100 PCIe4
# server boards (nvbandwidth's device_to_host_bidirectional_memcpy_ce, NVIDIA/nvbandwidth
# issues 11 and 53, where H2D drops to 11-13 meanwhile). No desktop board's duplex copies
# have been published: the presets apply the servers' figures to every card
DUPLEX_D2H_SHARE = 24 / 25.5
SERVER_DUPLEX = (
    "both ways at once: nvbandwidth on 8-GPU PCIe4 server boards (NVIDIA/nvbandwidth issues "
    "11, 15, 53), no desktop measurement published"
)


def _gpu(
    name, mem_gib, h2d_gbps, d2h_gbps, duplex_gbps, matmul_tflops, duplex_source=SERVER_DUPLEX
) -> dict:
    """A consumer card from measured rates: pinned copies in GB/s (H2D, D2H, H2D while D2H
    also runs), dense bf16 matmul TFLOP/s (a large torch.mm); `duplex_source`: where the
    rates both ways at once come from."""
    return {
        "name": name,
        "device": "cuda",
        "device_mem": int(mem_gib * GiB),
        "host_mem": 64 * GiB,
        "h2d_bps": h2d_gbps * 1e9,
        "d2h_bps": d2h_gbps * 1e9,
        "duplex_h2d_bps": duplex_gbps * 1e9,
        "duplex_d2h_bps": d2h_gbps * DUPLEX_D2H_SHARE * 1e9,
        "matmul_flops": matmul_tflops * 1e12 * TRAINING_SHARE_OF_MATMUL,
        # The host side is DRAM-bound: a desktop's dual-channel DDR5 (DESKTOP_DDR5_GBPS);
        # the update's rate takes 50 of its 60 GB/s, as one worker thread gets. An update
        # (norm dot, fused AdamW, bf16 refresh) touches ~46 bytes per parameter, a gradient
        # landing (bf16 or fp32 in, fp32 add) ~10-12 (measure_host_optimizer).
        "adam_s_per_param": 46 / 50e9,
        "accum_s_per_param": 12 / 50e9,
        "host_mem_bps": DESKTOP_DDR5_GBPS * 1e9,
        # The compact update is a dozen elementwise passes over cache-sized chunks: bound by
        # the cores, not DRAM.
        "compact_adam_s_per_param": COMPACT_NS_PER_CORE * 1e-9 / COMPACT_PRESET_CORES,
        # A PCIe4 NVMe SSD's sustained large transfers (the spec sheets' 7/6 GB/s are burst
        # figures into the drive's cache; a full-state write per step runs past it)
        "disk_read_bps": 5e9,
        "disk_write_bps": 2.5e9,
        "host_shares_compute": False,
        "rates_source": (
            f"stated: copies one way as measured on this card (profiler/hardware.py); "
            f"{duplex_source}; host memory {DESKTOP_DDR5_GBPS} GB/s, a dual-channel DDR5 "
            "desktop (AIDA64)"
        ),
    }


# Measured rates, not spec sheets. Matmul: bf16 torch.mm of 10240 x 10240 (6 warm-up, 30
# timed), community runs collected in github.com/zzc0721/torch-performance-test-data
# (database.md and its issues); independent runs agree within ~5%. Pinned copies: CUDA
# bandwidthTest or nvbandwidth output posted for that card; a PCIe4 x16 link moves ~24-27
# GB/s one way and roughly half of that H2D while D2H also runs, D2H barely slower
# (nvbandwidth's bidirectional tests on 8-GPU server boards: NVIDIA/nvbandwidth issues 11,
# 15 and 53; no desktop board's measurement has been published: `atom profile` on a real
# machine measures both ways at once, profiler/bandwidth.py). Where no measurement of a
# card was found the source says what stands in for it.
PRESETS: dict[str, dict] = {
    # fp16 only (no bf16), PCIe3; not measured: the effective 30 TFLOP/s of earlier
    # releases (spec-derived)
    "rtx2080ti": {
        **_gpu("RTX 2080 Ti (11 GB, PCIe3, fp16)", 11, 12, 12, 9, 30 / TRAINING_SHARE_OF_MATMUL),
        "dtype": "fp16",
    },
    # matmul 25.47 (zzc0721/torch-performance-test-data issue 131); bandwidthTest 23.3 H2D /
    # 25.7 D2H, 32 MB pinned (a posted "Windows WSL CUDA Install" guide); duplex: PCIe4 x16
    "rtx3060": _gpu("RTX 3060 (12 GB, PCIe4)", 12, 23.3, 25.7, 12, 25.5),
    # matmul 42.65 for the 16 GB card (database.md); link: PCIe4 x8, half of a x16's
    # measured ~24 (spec 15.75 GB/s theoretical, hardwareluxx review); no copy measured
    "rtx4060ti": _gpu("RTX 4060 Ti (16 GB, PCIe4 x8)", 16, 12, 13, 6.5, 42.7),
    # no measurement of the plain 4070 found: the 4070 SUPER's 74.5-76.8 (issue 54,
    # database.md) scaled by SM count, 46/56; link: the 4090's measured PCIe4 x16
    "rtx4070": _gpu("RTX 4070 (12 GB, PCIe4)", 12, 23.9, 26.5, 12, 61.6),
    # matmul 76.34 and 76.58 (database.md, two machines); link: the 4090's PCIe4 x16
    "rtx3090": _gpu("RTX 3090 (24 GB, PCIe4)", 24, 23.9, 26.5, 12, 76.3),
    # matmul 170.06 / 173.31 (database.md), 164.81 (issue 78); copies 23.85 H2D / 26.55
    # D2H, 16 MiB pinned (NVlabs/cuda-oxide PR 976); H2D under D2H 11-16 (nvbandwidth 15,
    # a server board, not this card's)
    "rtx4090": _gpu("RTX 4090 (24 GB, PCIe4)", 24, 23.9, 26.5, 12, 170),
    # matmul 242.18 (database.md; a cloud 5090 236.03, PR 15); nvbandwidth on a PCIe5
    # server: 56.3 H2D, 57.3 D2H, 50.9 H2D while D2H runs (tinygrad/open-gpu-kernel-modules
    # issue 29); D2H while H2D runs: DUPLEX_D2H_SHARE of the PCIe4 servers'
    "rtx5090": _gpu(
        "RTX 5090 (32 GB, PCIe5)",
        32,
        56.3,
        57.3,
        50.9,
        242,
        "both ways at once: nvbandwidth on a PCIe5 server (tinygrad/open-gpu-kernel-modules "
        "issue 29), no desktop measurement published",
    ),  # fmt: skip
    # not a consumer card, and not measured: the effective 400 TFLOP/s of earlier releases
    # (spec-derived); copies near our H100 run's 55.1 GB/s pinned each way
    # (docs/benchmarks.md)
    "h200": {
        **_gpu("H200 (141 GB, PCIe5)", 139, 50, 50, 35, 400 / TRAINING_SHARE_OF_MATMUL),
        # a server's host, not measured: one socket's 8 channels of DDR5-4800 are 307 GB/s
        # theoretical; taken at two thirds of it, as STREAM gets on such sockets
        "host_mem_bps": 200e9,
        "rates_source": f"stated: copies near our H100 run's; {SERVER_DUPLEX}; host memory "
        "200 GB/s, two thirds of a server socket's 8 DDR5-4800 channels",
    },
}


# The card's memory bandwidth, GB/s, as NVIDIA specifies it (peak: memory interface width x
# data rate; a large device copy gets less, not charged here: the update on the card moves
# ~24-32 bytes a parameter through it, milliseconds per unit against its backward's tens).
# NVIDIA's product pages (nvidia.com/en-us/geforce/graphics-cards/...; data-center/h200):
CARD_MEMORY = {
    "rtx2080ti": 616,  # .../rtx-2080-ti: 352-bit GDDR6 at 14 Gbps, 616 GB/s
    "rtx3060": 360,  # .../30-series/rtx-3060-3060ti: 12 GB, 192-bit GDDR6 at 15 Gbps
    # .../40-series/rtx-4060-4060ti: 128-bit GDDR6 at 18 Gbps (the page's 554 GB/s
    # "effective" counts hits in the L2 cache, which a streamed update does not get)
    "rtx4060ti": 288,
    "rtx4070": 504,  # .../40-series/rtx-4070-family: 192-bit GDDR6X at 21 Gbps
    "rtx3090": 936,  # .../30-series/rtx-3090-3090ti: 384-bit GDDR6X at 19.5 Gbps, 936 GB/s
    "rtx4090": 1008,  # .../40-series/rtx-4090: 384-bit GDDR6X at 21 Gbps, 1,008 GB/s
    "rtx5090": 1792,  # .../50-series/rtx-5090: 512-bit GDDR7 at 28 Gbps, 1,792 GB/s
    "h200": 4800,  # data-center/h200: 4.8 TB/s (HBM3e)
}
for _card, _gbps in CARD_MEMORY.items():
    PRESETS[_card]["card_mem_bps"] = _gbps * 1e9


def stated(spec: str, device_mem: int | None = None, host_mem: int | None = None) -> HardwareSpec:
    """A preset name or a JSON file, with optional memory overrides."""
    if spec in PRESETS:
        data = dict(PRESETS[spec])
    else:
        path = Path(spec)
        if not path.exists():
            raise ConfigError(
                f"unknown hardware {spec!r}: give a JSON file or one of {', '.join(PRESETS)}"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON ({err.msg}); fix the file") from None
    if device_mem is not None:
        data["device_mem"] = device_mem
    if host_mem is not None:
        data["host_mem"] = host_mem
    return HardwareSpec.from_dict(data)


def measure_host_optimizer(
    numel: int = 32_000_000, compute_dtype: torch.dtype = torch.float32
) -> tuple[float, float]:
    """Seconds per parameter of the host's work on a unit, as the swap engine does it:
    (update, landing). update = the gradient norm's dot product + torch's fused AdamW step
    + refreshing the compute-dtype copy that crosses the bus; landing = one gradient
    arriving from the device into the fp32 host gradient (a copy or an add).

    32M parameters (512 MB of state): large enough to be DRAM-bound and to amortise the
    thread pool's start-up, as a unit of a real model is. Adam alone at 4M parameters
    predicted the H100 machine's host side 2-3x off (docs/benchmarks.md)."""
    p = torch.zeros(numel)
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # state allocation is not per-step cost
    compute = p if compute_dtype == torch.float32 else torch.empty(numel, dtype=compute_dtype)

    def update() -> None:
        float(torch.dot(p.grad, p.grad))
        opt.step()
        if compute is not p:
            compute.copy_(p)

    upd = _median_time(update, 5) / numel
    # fp32 in: a unit's gradient summed over micro-batches on the device (unit-major); a
    # bf16 add (torch's mixed-dtype path) measured 10x slower on the H100 machine's host
    acc = torch.zeros(numel)
    land = _median_time(lambda: acc.add_(p.grad), 5) / numel
    return upd, land


def measure_compact_update(numel: int = 8_000_000, compiled: bool = True) -> float:
    """Seconds per parameter of one CompactAdamW unit update (swap.state=compact), the
    engine's own code on a unit of `numel` parameters (`compiled`: swap.compile_update)."""
    from atom.config import TrainConfig
    from atom.optim.compact import ChunkScratch, CompactAdamW
    from atom.optim.compact_kernel import CompiledChunkUpdate

    cfg = TrainConfig()
    master = torch.full((numel,), 0.02, dtype=torch.bfloat16)
    rem = torch.zeros(numel, dtype=torch.int16)
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    fused = CompiledChunkUpdate(cfg.beta1, cfg.beta2) if compiled else None
    opt = CompactAdamW(master, rem, grad, numel, numel, cfg, ChunkScratch(numel), False, fused)
    opt.step(1e-4)  # first touch of the state (and a compile) is not per-step cost
    return _median_time(lambda: opt.step(1e-4), 5) / numel


def measure_bf16_update(numel: int = 8_000_000) -> float:
    """Seconds per parameter of one Bf16AdamW unit update (swap.state=bf16: the weights as
    the master, 8-bit moments, stochastic rounding), the engine's own code."""
    from atom.config import TrainConfig
    from atom.optim.bf16 import Bf16AdamW, Bf16Scratch

    cfg = TrainConfig()
    master = torch.full((numel,), 0.02, dtype=torch.bfloat16)
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    opt = Bf16AdamW(master, grad, numel, numel, 0, cfg, Bf16Scratch(numel))
    opt.step(1e-4)  # first touch of the state is not per-step cost
    return _median_time(lambda: opt.step(1e-4), 5) / numel


def measure_unit_overhead(device: torch.device) -> tuple[float, float]:
    """Seconds the swap engine spends beyond compute and copies: (per unit visit, per unit
    update). Times training steps of a model so small that its copies and per-parameter
    work are negligible, at 1 and 4 micro-batches, and subtracts the compute the cost model
    already counts for the same model (its blocks, head and embedding timed alone, as
    `measure_pieces` times every model): the residual is what the piece times miss. A
    visit repeats with every micro-batch; a unit's update (its host-side Python: landing
    hand-off, norm, optimizer call, refresh) once per step. Counting the whole tiny step
    as overhead, as before, charged each visit its tiny block's compute a second time
    (1.0 ms a visit here against 0.17-0.22 of residual) and over-predicted plans of many
    micro-batches by 20-40%."""
    from atom.config import Config
    from atom.profiler.timing import measure_pieces
    from atom.swap.backend import CpuBackend, CudaBackend
    from atom.swap.engine import SwapEngine

    def tiny(accum: int) -> Config:
        return Config.from_dict(
            {
                "model": {"n_layer": 4, "n_head": 1, "d_model": 8, "seq_len": 8, "vocab_size": 16},
                # eager blocks: the residual is the engine's, not Inductor's compile
                "train": {"micro_batch": 1, "grad_accum": accum, "compile_blocks": "off"},
                "swap": {"layers_per_unit": 1, "prefetch": 1, "checkpoint": True},
            }
        )

    dtype = torch.float32
    x = torch.zeros(1, 8, dtype=torch.long)

    def residual(accum: int) -> tuple[float, int]:
        """(step seconds beyond the pieces' compute, units) at `accum` micro-batches."""
        cfg = tiny(accum)
        backend = CudaBackend(device, 1024, dtype) if device.type == "cuda" else CpuBackend()
        engine = SwapEngine(cfg, backend, dtype)
        batches = [(x, x)] * accum
        try:

            def step() -> None:
                engine.train_step(batches, 1e-4)
                engine.wait_idle()

            step()
            per_step = _median_time(step, 7)
        finally:
            engine.close()
        t = measure_pieces(cfg.model, 1, device, dtype)
        # checkpointed: every block runs forward twice (the pass, the recompute) and backward
        blocks = cfg.model.n_layer * (2 * t.block_fwd + t.block_bwd)
        return per_step - accum * (blocks + t.head + t.embed), len(engine.units)

    one, units = residual(1)
    four, _ = residual(4)
    visits = 2 * units - 1  # forward of every unit, backward of all but the head
    per_visit = max((four - one) / (3 * visits), 0.0)
    per_update = max((one - visits * per_visit) / units, 0.0)
    return per_visit, per_update


def measure(
    device: torch.device,
    transfer_numel: int,
    dtype: torch.dtype,
    device_mem: int | None = None,
    host_mem: int | None = None,
    disk_dir: str | None = None,
    progress: bool = False,
    compiled_update: bool = True,
) -> HardwareSpec:
    """Measure this machine at the transfer size the plan would use (and the disk of the
    NVMe tier, when there is one), with a progress line naming each measurement.
    `compiled_update`: swap.compile_update, as the compact update will run."""
    from tqdm import tqdm

    phases = 5 + (disk_dir is not None)
    with tqdm(total=phases, desc="measuring this machine", unit="step",
              disable=not progress) as bar:  # fmt: skip
        spec = _measure(device, transfer_numel, dtype, device_mem, host_mem, bar, compiled_update)
        if disk_dir is not None:
            bar.set_postfix_str(f"disk in {disk_dir}")
            if bar.disable:
                log.info("measuring this machine: disk speed in %s", disk_dir)
            spec.disk_read_bps, spec.disk_write_bps = measure_disk(disk_dir)
            bar.update()
    return spec


def _measure(
    device: torch.device,
    transfer_numel: int,
    dtype: torch.dtype,
    device_mem: int | None,
    host_mem: int | None,
    bar,
    compiled_update: bool = True,
) -> HardwareSpec:
    vm = psutil.virtual_memory()
    host = host_mem if host_mem is not None else vm.available

    def phase(name: str, fn):
        bar.set_postfix_str(name)
        if bar.disable:  # not a terminal: a log line per measurement instead
            log.info("measuring this machine: %s", name)
        result = fn()
        bar.update()
        return result

    adam, add = phase("host AdamW", lambda: measure_host_optimizer(compute_dtype=dtype))
    host_bps = measure_host_memory()
    compact = phase(
        # the first run on a machine compiles the compact update (Inductor caches it)
        "compact AdamW" + (" (compiled once, ~30 s)" if compiled_update else ""),
        lambda: measure_compact_update(compiled=compiled_update),
    )
    overhead, update_overhead = phase("per-unit overhead", lambda: measure_unit_overhead(device))
    bar.set_postfix_str("bandwidth")
    if bar.disable:
        log.info("measuring this machine: host<->device bandwidth")
    # at least 64 MiB: smaller copies run from cache and overstate DRAM bandwidth
    numel = max(transfer_numel, 1 << 24)
    if device.type == "cpu":
        src, dst = torch.randn(numel).to(dtype), torch.empty(numel, dtype=dtype)
        bps = copy_bps(dst, src)
        bar.update(2)
        # the "device" is host memory: by default let the plan use what model state leaves
        return HardwareSpec(
            name=f"CPU ({psutil.cpu_count()} cores, {vm.total / GiB:.0f} GiB)",
            device="cpu",
            device_mem=device_mem if device_mem is not None else host // 2,
            host_mem=host,
            h2d_bps=bps,
            d2h_bps=float("inf"),
            duplex_h2d_bps=bps,
            matmul_flops=0.0,
            adam_s_per_param=adam,
            accum_s_per_param=add,
            host_shares_compute=True,
            measured=True,
            unit_overhead_s=overhead,
            unit_update_overhead_s=update_overhead,
            compact_adam_s_per_param=compact,
            host_mem_bps=host_bps,
            rates_source="measured here (memcpy on this machine's cores)",
        )
    free, total = torch.cuda.mem_get_info(device)
    h2d, d2h = one_way(device, numel, dtype)
    # both ways at once: 64 MiB a copy is past the link's ramp and costs 512 MiB in all
    duplex_up, duplex_down = measure_duplex(device, min(numel, (1 << 26) // dtype.itemsize), dtype)
    card_mem = measure_card_memory(device)
    bar.update(2)
    margin = max(GiB // 2, int(0.05 * total))  # CUDA context, allocator slack, fragmentation
    return HardwareSpec(
        name=torch.cuda.get_device_name(device),
        device="cuda",
        dtype={torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "bf16"),  # measured in
        device_mem=device_mem if device_mem is not None else max(0, free - margin),
        host_mem=host,
        h2d_bps=h2d,
        d2h_bps=d2h,
        duplex_h2d_bps=duplex_up,
        duplex_d2h_bps=duplex_down,
        matmul_flops=0.0,
        adam_s_per_param=adam,
        accum_s_per_param=add,
        host_shares_compute=False,
        measured=True,
        unit_overhead_s=overhead,
        unit_update_overhead_s=update_overhead,
        compact_adam_s_per_param=compact,
        card_mem_bps=card_mem,
        host_mem_bps=host_bps,
        rates_source="measured here (pinned copies, both ways at once on two streams)",
    )
