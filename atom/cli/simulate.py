"""`atom simulate`: predict tokens/s and time-to-loss of atom, GPipe pipeline parallel and
synchronous data parallel for a group you describe, before buying or wiring anything.

    atom simulate --config gpt3-2.7b --hardware rtx4090 --host-mem 192GiB --peers 8 \
        --link-mbps 100 1000 10000 --batch 32
    atom simulate --config gpt3-1.3b gpt3-2.7b --hardware rtx3090 rtx4090 --peers 4 \
        --link-mbps 100 --latency-ms 20 --codec bf16 --json out.json
    atom simulate --links links.json --hardware measured        # a 4 x 4 matrix in Mb/s
    atom simulate --hardware runs/bench_vs_pipeline/profile.json --compute-scale 2 ...

--hardware takes a preset (rtx2080ti, rtx3060, rtx4060ti, rtx4070, rtx3090, rtx4090,
rtx5090, h200; block times from FLOPs), a HardwareSpec JSON, `measured` (this machine, as
`atom profile` measures it; cached), or a profile.json written by tools/bench/vs_pipeline.py.
The model is profiler/simulate.py; its assumptions are in that module's docstring.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from atom.config import Config, ConfigError
from atom.ground.sizes import parse_bytes
from atom.run.run_config import load_run_config

log = logging.getLogger(__name__)

DAY = 86400.0


def add_command(sub) -> None:
    s = sub.add_parser(
        "simulate",
        help="predict tokens/s and time-to-loss: atom vs pipeline vs data parallel",
        description=__doc__.split("\n\n")[0],
    )
    s.add_argument(
        "--config",
        nargs="+",
        default=[None],
        metavar="NAME|FILE",
        help="one or more configs (default: the tiny model)",
    )
    s.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=V",
        help="override a config value (repeatable)",
    )
    s.add_argument(
        "--hardware",
        nargs="+",
        default=["measured"],
        metavar="NAME|JSON",
        help="each peer's machine: preset, JSON, `measured` or a bench profile.json",
    )
    s.add_argument("--gpu-mem", help="device memory per peer, e.g. 24GiB (default: the spec's)")
    s.add_argument("--host-mem", help="host RAM per peer, e.g. 128GiB (default: the spec's)")
    s.add_argument("--peers", type=int, default=4, help="peers in the group (default 4)")
    s.add_argument(
        "--link-mbps",
        type=float,
        nargs="+",
        default=[100.0],
        help="uniform link rates to tabulate, Mb/s (default 100)",
    )
    s.add_argument("--links", help="JSON file: a peers x peers matrix of Mb/s (i -> j)")
    s.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency per link")
    s.add_argument(
        "--batch", type=int, help="sequences per peer per step (default micro_batch x grad_accum)"
    )
    s.add_argument("--chunks", type=int, help="pipeline micro-batches per step (default 2 x peers)")
    s.add_argument(
        "--plan",
        choices=["best", "config"],
        default="best",
        help="atom's partition: the planner's fastest (default) or the config's",
    )
    s.add_argument("--codec", choices=["fp32", "bf16", "int8", "topk"], help="gossip codec")
    s.add_argument("--tau0", type=float, help="convergence constant (default: fitted)")
    s.add_argument(
        "--tokens",
        type=float,
        help="tokens sync SGD needs to reach the target loss (default 20 x params)",
    )
    s.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        help="slow compute by this factor (processes sharing cores)",
    )
    s.add_argument("--json", metavar="OUT", help="also write every prediction as JSON")
    s.add_argument(
        "--wide",
        action="store_true",
        help="one row per model x machine x link, the three systems side by side",
    )


# ------------------------------------------------------------------ inputs
def machine(cfg: Config, spec: str, gpu_mem: int | None, host_mem: int | None, sizes: list[int],
            scale: float):  # fmt: skip
    """(Machine, label) for one --hardware value."""
    from atom.profiler import hardware, timing
    from atom.profiler.analysis import ModelAnalysis
    from atom.profiler.profile import cached_hardware, stated_dtype
    from atom.profiler.simulate import Machine
    from atom.profiler.timing import PieceTimes

    path = Path(spec)
    if spec == "measured":
        from atom.ground.device import resolve_device

        device, dtype = resolve_device(cfg)
        cache = timing.TimingCache(timing.cache_key(cfg, device, dtype))
        hw = cached_hardware(cfg, device, dtype, cache)
        for mb in sizes:
            if cache.pieces(mb) is None:
                cache.put_pieces(mb, timing.measure_pieces(cfg.model, mb, device, dtype))
        cache.save()
        table = {mb: cache.pieces(mb) for mb in sizes}
        label = f"{hw.name} (measured)"
    elif path.suffix == ".json" and path.exists() and "pieces" in json.loads(path.read_text()):
        data = json.loads(path.read_text())
        hw = hardware.HardwareSpec.from_dict(data["hardware"])
        import torch  # here, not at the top: `atom --help` and `atom peers` never need it

        dtype = torch.float32 if hw.device == "cpu" else stated_dtype(hw, cfg)
        table = {int(k): PieceTimes(**v) for k, v in data["pieces"].items()}
        label = f"{hw.name} ({path.name})"
    else:
        hw = hardware.stated(spec)
        dtype = stated_dtype(hw, cfg)
        if hw.matmul_flops <= 0:
            raise ConfigError(f"hardware {spec}: a stated spec needs matmul_flops > 0")
        a = ModelAnalysis.of(cfg)
        table = {mb: timing.estimate_pieces(a, mb, hw) for mb in sizes}
        label = hw.name.split(" (")[0]
    if gpu_mem is not None:
        hw.device_mem = gpu_mem
    if host_mem is not None:
        hw.host_mem = host_mem
    return Machine(hw, dtype, timing.scaled_times(table), scale), label


def _link_sets(args, peers: int):
    from atom.profiler.simulate import Links

    lat = args.latency_ms / 1000
    if args.links:
        try:
            matrix = json.loads(Path(args.links).read_text())
            links = Links(matrix, lat)
        except (OSError, json.JSONDecodeError, TypeError, ValueError) as err:
            raise ConfigError(f"--links {args.links}: {err}") from None
        if links.peers != peers:
            raise ConfigError(f"--links has {links.peers} peers but --peers is {peers}")
        return [("matrix", links)]
    return [(f"{r:g} Mb/s", Links.uniform(peers, r, lat)) for r in args.link_mbps]


def _chunks(peers: int, batch: int, want: int | None) -> int:
    total = peers * batch
    if want is not None:
        if want < 1 or total % want:
            raise ConfigError(f"--chunks must divide peers x batch = {total}")
        return want
    return max(c for c in range(1, 2 * peers + 1) if total % c == 0)


# ------------------------------------------------------------------ output
def _duration(s: float) -> str:
    if s >= 2 * DAY:
        return f"{s / DAY:.1f} d"
    if s >= 7200:
        return f"{s / 3600:.1f} h"
    return f"{s:.0f} s"


def format_rows(rows: list[dict]) -> str:
    head = ("| model | machine | link | system | step s | tokens/s | vs pipeline | exposed comm s "
            "| tau steps | eta | time to target | note |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        tau = r["detail"].get("tau_steps")
        fits = "" if r["fits"] else " (does not fit)"
        lines.append(
            f"| {r['model']} | {r['machine']} | {r['link']} | {r['system']}{fits} | "
            f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['vs_pipeline']:.2f}x | "
            f"{r['comm_s']:.3f} | {'' if tau is None else f'{tau:.1f}'} | "
            f"{r['efficiency']:.2f} | {_duration(r['time_to_target_s'])} | {r['note']} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict]:
    from atom.profiler.analysis import ModelAnalysis
    from atom.profiler.cost import Candidate
    from atom.profiler.planner import Infeasible
    from atom.profiler.simulate import Workload, simulate

    if args.peers < 2:
        raise ConfigError("--peers must be >= 2")
    gpu_mem = parse_bytes(args.gpu_mem) if args.gpu_mem else None
    host_mem = parse_bytes(args.host_mem) if args.host_mem else None
    rows = []
    for name in args.config:
        cfg = load_run_config(name, args.overrides)
        batch = args.batch or cfg.train.micro_batch * cfg.train.grad_accum
        chunks = _chunks(args.peers, batch, args.chunks)
        from atom.gossip.net.codecs import get_codec

        codec = get_codec(args.codec or cfg.gossip.codec, cfg.gossip.topk_fraction)
        w = Workload(args.peers, batch, chunks, codec.wire_bytes, cfg.gossip.lanes,
                     cfg.gossip.interval_s, args.tau0, cfg.gossip.strategy,
                     cfg.gossip.diloco_steps)  # fmt: skip
        plan = None
        if args.plan == "config":
            s = cfg.swap
            plan = Candidate(s.layers_per_unit, s.prefetch, cfg.train.micro_batch,
                             cfg.train.grad_accum, s.checkpoint, s.offload_activations,
                             s.order)  # fmt: skip
        sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= batch}
                       | {batch, w.pipeline_micro})  # fmt: skip
        n_params = ModelAnalysis.of(cfg).n_params
        target = args.tokens or 20 * n_params
        for spec in args.hardware:
            m, label = machine(cfg, spec, gpu_mem, host_mem, sizes, args.compute_scale)
            for link_label, links in _link_sets(args, args.peers):
                try:
                    preds = simulate(cfg, m, links, w, plan)
                except Infeasible as err:
                    raise ConfigError(f"{name or 'tiny'} on {label}: {err}") from None
                pipe = next(p for p in preds if p.system == "pipeline")
                for p in preds:
                    rows.append({
                        **p.to_dict(), "model": name or "tiny", "machine": label,
                        "link": link_label, "peers": args.peers, "peer_batch": batch,
                        "vs_pipeline": p.tokens_per_s / pipe.tokens_per_s,
                        "target_tokens": target, "time_to_target_s": p.time_to(target),
                    })  # fmt: skip
    return rows


def format_wide(rows: list[dict]) -> str:
    """The three systems side by side: tokens/s, time to target, atom's speed-ups."""
    head = (
        "| model | machine | link | atom tokens/s | pipeline | ddp | atom / pipeline | "
        "atom time | pipeline time | ddp time | atom / pipeline (time) | atom tau, eta |"
    )
    lines = [head, "|" + "---|" * 12]
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["model"], r["machine"], r["link"]), {})[r["system"]] = r
    for (model, mach, link), g in groups.items():
        a, p, d = g["atom"], g["pipeline"], g["ddp"]

        def fit(r: dict) -> str:
            return "" if r["fits"] else " (does not fit)"

        lines.append(
            f"| {model} | {mach} | {link} | {a['tokens_per_s']:,.0f} | "
            f"{p['tokens_per_s']:,.0f}{fit(p)} | {d['tokens_per_s']:,.0f} | "
            f"{a['tokens_per_s'] / p['tokens_per_s']:.1f}x | {_duration(a['time_to_target_s'])} | "
            f"{_duration(p['time_to_target_s'])} | {_duration(d['time_to_target_s'])} | "
            f"{p['time_to_target_s'] / a['time_to_target_s']:.1f}x | "
            f"{a['detail']['tau_steps']:.1f}, {a['efficiency']:.2f} |"
        )
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    rows = run(args)
    first = rows[0]
    print(
        f"atom: {args.peers} peers, {first['peer_batch']} sequences per peer per step; target: "
        f"the loss sync SGD reaches after {first['target_tokens']:.3g} tokens "
        "(--tokens; default 20 per parameter)"
    )
    print(format_wide(rows) if args.wide else format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"atom: wrote {args.json}")
    return 0


HANDLERS = {"simulate": cmd_simulate}
