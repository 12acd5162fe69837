"""Swapped vs resident step time, measured side by side in one run, with the traffic.

On CPU (the CPU backend; what CI machines have), the issue's small shape (6 layers,
d_model 256, context 128, one layer per unit, prefetch 1) at micro-batch 4 x 1 and
2 x 8, with and without recompute:

    python -m tools.bench.swap --rounds 5 --steps 10
    python -m tools.bench.swap --config gpt2-124m --set model.seq_len=256 --rounds 3

Each engine runs in its own process, as a user runs it (two engines in one process share
OpenMP teams: the resident baseline slowed beside the swapped engine's threads, and the
ratio read 1.06x where `atom train` against `atom train --resident` read 1.5x). Each
round starts a fresh process per side; after a warm-up it times --steps optimizer steps
as training runs (back to back), until its last host work has finished (an engine kept
alive and idle between short blocks read slower, unevenly). On the CPU each round also
runs `atom train` and `atom train --resident` on the same config (the median step_time_s
of each run past its first 5 steps): the engines' ratio and theirs must agree. The sides
of a round run in an order reversed every other round, and a ratio is the median of the
per-round ratios with their spread (min-max), so the phases of a shared machine weigh on
both sides of a pair alike (bench_config says more). A swapped run with recompute
(swap.checkpoint: true) is compared with a resident run that also recomputes (activation
checkpointing per block), so the ratio is the cost of swapping, not of recomputing.

Per configuration it also reports:
- H2D bytes per step (counted per copy) and the minimum: every unit once for the forward
  and once for the backward, less the units kept on the device between the two;
- D2H gradient copies and bytes per step, and the minimum (each unit once);
- exposed host time per step: compute waiting for a copy that waited for the host
  optimizer, plus waiting at the end of the step for gradients and norms to land.

On a GPU:

    python -m tools.bench.swap --config gpt3-2.7b --set model.vocab_size=256 \
        --set train.micro_batch=1 --accum 8 --gpu-mem 24GiB --rounds 2

caps device memory (torch.cuda.set_per_process_memory_fraction) to emulate a consumer
card and reports the resident run as OOM when it does not fit, the pinned H2D bandwidth
and the bus floor (bytes counted / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time

import psutil
import torch

from atom.config import Config, load_config, replace
from atom.ground.device import resolve_device
from atom.ground.sizes import parse_bytes
from atom.run.train import build_engine
from tools import tool_env

log = logging.getLogger("bench_swap")

SMALL_SHAPE = [
    "model.n_layer=6",
    "model.d_model=256",
    "model.n_head=4",
    "model.seq_len=128",
    "swap.layers_per_unit=1",
    "swap.prefetch=1",
]


def make_batches(cfg: Config, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch, cfg.model.seq_len + 1)
    out = []
    for _ in range(cfg.train.grad_accum):
        x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def pinned_bandwidth(numel: int, dtype: torch.dtype, device, reps: int = 10) -> float:
    host = torch.empty(numel, dtype=dtype, pin_memory=True)
    dev = torch.empty(numel, dtype=dtype, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return reps * host.nbytes / (time.perf_counter() - t0)


def min_traffic(engine) -> tuple[int, int]:
    """(H2D, D2H) bytes per step no schedule can beat: each unit's weights once per pass
    (the last `prefetch` body units stay between forward and backward), each gradient once."""
    dt = torch.empty(0, dtype=engine.dtype).element_size()
    sizes = [u.n_total * dt for u in engine.units]
    body = sizes[:-1]
    kept = min(engine.cfg.swap.prefetch, len(body))
    h2d = sum(sizes) + sum(body[: len(body) - kept])
    return h2d, sum(sizes)


class Block:
    """Times `steps` consecutive optimizer steps of one engine."""

    def __init__(self, engine, cfg: Config, sync):
        self.engine, self.cfg, self.sync = engine, cfg, sync
        self.seed = 0

    def run(self, steps: int) -> float:
        batches = [make_batches(self.cfg, self.seed + i) for i in range(steps)]
        self.seed += steps
        t0 = time.perf_counter()
        for b in batches:
            self.engine.train_step(b, 1e-4)
        self.engine.wait_idle()
        self.sync()
        return (time.perf_counter() - t0) / steps


def _counters(engine) -> dict:
    return {
        "h2d": engine.slots.bytes_loaded,
        "d2h": engine.d2h_bytes,
        "d2h_copies": engine.d2h_copies,
        "opt_wait": engine.slots.optimizer_wait_s,
        "load_wait": engine.slots.load_wait_s,
        "norm_wait": engine.norm_wait_s,
    }


def serve(side: str, cfg_json: str, gpu_mem: str | None) -> int:
    """One engine in this process, as a user runs it: answers `run N` (time N steps as a
    block) and `stats` on stdin with one JSON line each on stdout, until `quit`."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_flush_denormal(True)
    cfg = Config.from_dict(json.loads(cfg_json))
    device, dtype = resolve_device(cfg)
    cuda = device.type == "cuda"
    if cuda and gpu_mem:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(gpu_mem) / total), device)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    reply = lambda obj: print(json.dumps(obj), flush=True)  # noqa: E731
    try:
        if side == "swapped":
            engine = build_engine(cfg, resident=False)
        else:
            from atom.resident.engine import ResidentEngine

            engine = ResidentEngine(cfg, device, dtype, recompute=cfg.swap.checkpoint)
        block = Block(engine, cfg, sync)
        block.run(2 if side == "swapped" else 1)  # warm-up: allocation, first touch, state
    except torch.cuda.OutOfMemoryError:
        reply({"oom": True})
        return 0
    peak = engine.device_peak_bytes()
    before, steps = (_counters(engine) if side == "swapped" else {}), 0
    reply({"ready": True})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "run":
            try:
                reply({"s_per_step": block.run(int(cmd[1]))})
                steps += int(cmd[1])
            except torch.cuda.OutOfMemoryError:
                reply({"oom": True})
        elif cmd[0] == "stats":
            out: dict = {"device_peak_bytes": peak}
            if side == "swapped" and steps:
                after = _counters(engine)
                out["per_step"] = {k: (after[k] - before[k]) / steps for k in after}
                out["min_traffic"] = min_traffic(engine)
                if cuda:
                    unit_numel = max(u.n_total for u in engine.units)
                    out["pinned_h2d_bps"] = pinned_bandwidth(unit_numel, engine.dtype, device)
            reply(out)
    if hasattr(engine, "close"):
        engine.close()
    return 0


class _Side:
    """A `serve` child process: one engine, commands on stdin, JSON lines back."""

    def __init__(self, side: str, cfg: Config, gpu_mem: str | None):
        import subprocess

        argv = [sys.executable, "-m", "tools.bench.swap", "--serve", side,
                json.dumps(cfg.to_dict())]  # fmt: skip
        argv += ["--gpu-mem", gpu_mem] if gpu_mem else []
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=tool_env())  # fmt: skip
        self.ready = "ready" in self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark child ended ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def bench_config(
    cfg: Config,
    rounds: int,
    steps: int,
    resident_too: bool = True,
    gpu_mem: str | None = None,
    cli_rounds: int = 0,
    cli_steps: int = 20,
) -> dict:
    """Swapped and resident engines, each in a process of its own (as a user runs them:
    two engines in one process share OpenMP teams, and the resident baseline measured
    beside a swapped engine's threads ran slower, flattering the ratio); in the first
    `cli_rounds` rounds also `atom train` and `atom train --resident`.

    Each round runs every side once, each in a fresh process that warms up and times
    `steps` steps back to back, in an order reversed every other round (A B C D, D C B A:
    a shared machine that speeds up or slows down within a round weighs on both sides of
    each pair alike). A ratio is the median of the per-round ratios, whose two sides ran
    seconds apart, with their spread (min-max): on a shared VM the step time of one side
    alone moved 1.7x between phases of seconds, so ratios of medians taken at different
    times (the engines' rounds first, `atom train`'s after) disagreed by up to 30%."""
    sides = [("engine", "swapped")] + ([("engine", "resident")] if resident_too else [])
    if resident_too and cli_rounds:
        sides += [("cli", "swapped"), ("cli", "resident")]
    times: dict[tuple[str, str], list[float]] = {k: [] for k in sides}
    stats: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = _cli_config(cfg, tmp) if cli_rounds else None
        for r in range(rounds):
            for kind, name in sides if r % 2 == 0 else sides[::-1]:
                if (kind, name) not in times or (kind == "cli" and r >= cli_rounds):
                    continue
                if kind == "cli":
                    times[kind, name].append(_cli_run(config, name, cli_steps, f"{tmp}/{r}"))
                    continue
                side = _Side(name, cfg, gpu_mem)
                try:
                    reply = side.ask(f"run {steps}") if side.ready else {"oom": True}
                    if reply.get("oom"):
                        if name == "swapped":
                            raise RuntimeError("the swapped engine does not fit the device")
                        log.warning("resident training does not fit: out of device memory")
                        for gone in [k for k in times if k[1] == "resident"]:
                            times.pop(gone)
                        continue
                    times[kind, name].append(reply["s_per_step"])
                    if name == "swapped" and r == rounds - 1:
                        stats = side.ask("stats")
                finally:
                    side.close()
    per = stats["per_step"]
    h2d_min, d2h_min = stats["min_traffic"]
    result = {
        "swap": cfg.to_dict()["swap"],
        "micro_batch": cfg.train.micro_batch,
        "grad_accum": cfg.train.grad_accum,
        "swapped_step_s": statistics.median(times["engine", "swapped"]),
        "h2d_bytes_per_step": per["h2d"],
        "h2d_min_bytes": h2d_min,
        "d2h_copies_per_step": per["d2h_copies"],
        "d2h_bytes_per_step": per["d2h"],
        "d2h_min_bytes": d2h_min,
        "load_wait_s_per_step": per["load_wait"],
        "exposed_host_s_per_step": per["opt_wait"] + per["norm_wait"],
        "device_peak_bytes": stats["device_peak_bytes"],
        "resident_step_s": None,
        "per_round_s": {f"{kind} {name}": t for (kind, name), t in times.items()},
    }
    for kind, prefix in (("engine", ""), ("cli", "cli_")):
        if (kind, "resident") not in times or not times[kind, "resident"]:
            continue
        swapped, resident = times[kind, "swapped"], times[kind, "resident"]
        ratios = [s / r for s, r in zip(swapped, resident, strict=False)]
        result[f"{prefix}swapped_step_s"] = statistics.median(swapped)
        result[f"{prefix}resident_step_s"] = statistics.median(resident)
        result[f"{prefix}ratio"] = statistics.median(ratios)
        result[f"{prefix}ratio_spread"] = [min(ratios), max(ratios)]
    tokens = cfg.train.micro_batch * cfg.train.grad_accum * cfg.model.seq_len
    result["swapped_tokens_per_s"] = tokens / result["swapped_step_s"]
    if "pinned_h2d_bps" in stats:
        bw = stats["pinned_h2d_bps"]
        result["pinned_h2d_GBps"] = bw / 1e9
        result["bus_floor_s"] = per["h2d"] / bw
        result["achieved_h2d_fraction"] = per["h2d"] / result["swapped_step_s"] / bw
    return result


def _cli_config(cfg: Config, tmp: str) -> str:
    """cfg as a YAML file for `atom train --config`, without evaluation or checkpoints."""
    from pathlib import Path

    import yaml

    config = Path(tmp) / "config.yaml"
    data = cfg.to_dict()
    data["train"].update(eval_interval=0, ckpt_interval=0, max_steps=10**6)
    config.write_text(yaml.safe_dump(data))
    return str(config)


def _cli_run(config: str, side: str, steps: int, out: str) -> float:
    """One `atom train` (side "resident": `--resident`) as a user runs it: the median of
    its step_time_s (metrics.jsonl) past its first 5 steps."""
    import subprocess

    out = f"{out}_{side}"
    argv = [sys.executable, "-m", "atom.cli", "train", "--config", config,
            "--max-steps", str(steps + 5), "--out", out, "--no-progress"]  # fmt: skip
    if side == "resident":
        argv.append("--resident")
    subprocess.run(argv, check=True, capture_output=True)
    with open(f"{out}/metrics.jsonl") as f:
        return statistics.median([json.loads(line)["step_time_s"] for line in f][5:])


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # a child: one side of the comparison
        gpu_mem = argv[argv.index("--gpu-mem") + 1] if "--gpu-mem" in argv else None
        return serve(argv[1], argv[2], gpu_mem)
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=None, help="default: the small shape above")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=5, help="processes per engine, alternating")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per process")
    ap.add_argument(
        "--shapes",
        default="4x1,2x8",
        help="micro-batch x grad_accum pairs (default 4x1,2x8)",
    )
    ap.add_argument("--recompute", default="no,yes", help="swap.checkpoint values to run")
    ap.add_argument("--order", default="unit", help="swap.order values to run (unit,micro)")
    ap.add_argument("--no-resident", action="store_true", help="swapped only (model too big)")
    ap.add_argument("--gpu-mem", default=None, help="cap device memory, e.g. 24GiB")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--cli-rounds", type=int, default=None,
                    help="on the CPU also `atom train` vs `atom train --resident`, in this "
                         "many of the rounds (default: every round; 0: none)")  # fmt: skip
    ap.add_argument("--cli-steps", type=int, default=20, help="timed steps per atom train run")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_flush_denormal(True)
    base = SMALL_SHAPE if args.config is None else []
    cfg = load_config(args.config, base + args.overrides)
    device, dtype = resolve_device(cfg)
    hardware = (
        f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    print(
        f"# bench_swap {time.strftime('%Y-%m-%d')} on {hardware}; torch {torch.__version__}; "
        f"{dtype}; {args.rounds} rounds x {args.steps} steps"
    )
    print(
        "| micro x accum | recompute | order | swapped s | resident s | ratio (spread) | "
        "atom train ratio (spread) | H2D MiB/step (min) | D2H copies, MiB/step (min) | "
        "exposed host s/step |"
    )
    print("|---|---|---|---:|---:|---|---|---|---|---:|")
    results = []
    for shape in args.shapes.split(","):
        micro, accum = (int(v) for v in shape.lower().split("x"))
        for ck in args.recompute.split(","):
            for order in args.order.split(","):
                run_cfg = replace(
                    cfg,
                    train={"micro_batch": micro, "grad_accum": accum},
                    swap={"checkpoint": ck == "yes", "order": order},
                )
                cpu_pairs = args.cli_rounds if device.type == "cpu" else 0
                r = bench_config(
                    run_cfg, args.rounds, args.steps, not args.no_resident, args.gpu_mem,
                    args.rounds if cpu_pairs is None else cpu_pairs, args.cli_steps,
                )  # fmt: skip
                cli = "-"
                if "cli_ratio" in r:
                    lo, hi = r["cli_ratio_spread"]
                    cli = f"{r['cli_ratio']:.3f}x ({lo:.2f}-{hi:.2f})"
                results.append(r)
                if r["resident_step_s"]:
                    lo, hi = r["ratio_spread"]
                    ratio = f"{r['ratio']:.3f}x ({lo:.2f}-{hi:.2f})"
                    res = f"{r['resident_step_s']:.4f}"
                else:
                    ratio, res = "-", "OOM" if not args.no_resident else "-"
                print(
                    f"| {micro} x {accum} | {ck} | {order} | {r['swapped_step_s']:.4f} | {res} | "
                    f"{ratio} | {cli} | {_mib(r['h2d_bytes_per_step'])} "
                    f"({_mib(r['h2d_min_bytes'])}) | "
                    f"{r['d2h_copies_per_step']:.0f}, {_mib(r['d2h_bytes_per_step'])} "
                    f"({_mib(r['d2h_min_bytes'])}) | {r['exposed_host_s_per_step']:.4f} |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
