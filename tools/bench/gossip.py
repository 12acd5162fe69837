"""Peers benchmark: gossip's cost to a training step, exchange throughput on a shaped
link, and flow-based vs random partner choice on a two-site network.

    python -m tools.bench.gossip overhead --steps 200 --repeats 5
    python -m tools.bench.gossip throughput --mbps 20 100 1000 --exchanges 20
    python -m tools.bench.gossip sites --seconds 60 --repeats 2 --data sites iid --lanes 1 2
    python -m tools.bench.gossip all          # the three above (defaults): docs/benchmarks.md

overhead    two `atom train` processes side by side (one thread each), once training
            alone and once as a gossip group; median step time of the same steps. Both
            cases run two trainers, so the CPU they share is the same; the difference is
            what gossip costs.
throughput  one peer exchanges the largest unit back to back with a peer in another
            process over a link shaped to R Mb/s each way (application-level token
            bucket); bytes moved per second against R (a push-pull uses one direction at
            a time, so R is the ceiling).
sites       four peers in two sites (1 Gb/s inside a site, 20 Mb/s across, shaped in
            the transport); site 0 trains on one shard, site 1 on another with no word
            in common. Equal wall time for `gossip.selection` flow and random, then the
            consensus distance (RMS distance of each peer's weights from their mean) and
            the validation loss on the union of both shards.

Everything runs on loopback; every child is waited for or killed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tools import tool_env
from tools.jsonl import read_records

ATOM = [sys.executable, "-m", "atom.cli", "train", "--no-progress"]
WORDS = [
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split(),
    "north south east west river mountain valley forest desert ocean island harbor".split(),
]
MODEL = ["--set", "model.n_layer=4", "--set", "model.d_model=128", "--set", "model.n_head=4"]
COMMON = [
    "--set", "train.device=cpu", "--set", "train.dtype=fp32", "--set", "train.eval_interval=0",
    "--set", "train.ckpt_interval=0", "--set", "train.micro_batch=8",
    "--set", "gossip.heartbeat_s=0.5", "--set", "gossip.dead_after_s=3",
    # the figures in docs/benchmarks.md "Peers" are plain fp32 averaging's
    "--set", "gossip.strategy=gossip", "--set", "gossip.codec=fp32",
]  # fmt: skip


# ------------------------------------------------------------------ helpers
def prepare_data(root: Path) -> tuple[list[Path], Path]:
    from atom.data.tokens import prepare

    root.mkdir(parents=True, exist_ok=True)
    shards, texts = [], []
    for k, words in enumerate(WORDS):
        rng = random.Random(k)
        lines = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(4000)]
        texts.append(lines)
        (root / f"shard{k}.txt").write_text("\n".join(lines))
        if not (root / f"shard{k}" / "meta.json").exists():
            prepare([root / f"shard{k}.txt"], root / f"shard{k}", progress=False)
        shards.append(root / f"shard{k}")
    union = [line for pair in zip(*texts, strict=True) for line in pair]
    (root / "union.txt").write_text("\n".join(union))
    if not (root / "union" / "meta.json").exists():
        prepare([root / "union.txt"], root / "union", progress=False)
    return shards, root / "union"


def _default_sigint() -> None:
    # a shell's background job ignores SIGINT, and children inherit that: peers are
    # stopped with SIGINT (Ctrl+C: checkpoint, goodbye), so give them the default back
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(args: list[str], log: Path, cmd: list[str] = ATOM) -> subprocess.Popen:
    env = tool_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd + args, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_default_sigint
        )


def status(run: Path) -> dict:
    try:
        return json.loads((run / "gossip.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def cpu_seconds(procs: list[subprocess.Popen]) -> list[float]:
    """Wait for each child; the CPU seconds it used, all threads (immune to the machine
    being slowed by others, unlike wall time)."""
    out = []
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.append(usage.ru_utime + usage.ru_stime)
    return out


def records(run: Path) -> list[dict]:
    return read_records(run / "metrics.jsonl")


def weights(run: Path) -> torch.Tensor:
    from atom.store.checkpoint import load_checkpoint

    ckpt = load_checkpoint(run)
    names = sorted(n for n in ckpt.names() if not n.startswith("optim."))
    return torch.cat([ckpt.get(n).reshape(-1).float() for n in names])


def consensus(runs: list[Path]) -> float:
    xs = torch.stack([weights(r) for r in runs])
    return float((xs - xs.mean(0)).pow(2).mean().sqrt())


def val_loss(run: Path, data: Path) -> float:
    from atom.config import Config
    from atom.run.train import Trainer

    saved = json.loads((run / "config.json").read_text())
    saved["gossip"] = {}
    saved["train"].update(data=str(data), eval_batches=20)
    trainer = Trainer(
        Config.from_dict(saved), run / "eval", resident=True, resume=run, progress=False
    )
    try:
        return trainer.evaluate()
    finally:
        trainer.engine.close()


# ------------------------------------------------------------------ (a) overhead
def bench_overhead(work: Path, steps: int, repeats: int) -> dict:
    shards, _ = prepare_data(work / "data")
    args = MODEL + COMMON + ["--set", f"train.data={shards[0]}", "--max-steps", str(steps)]
    results: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    exchanges = []
    for r in range(repeats):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # ABBA: cancels drift
            runs = [work / f"overhead_{mode}_{r}_{k}" for k in range(2)]
            for run in runs:
                if run.exists():
                    shutil.rmtree(run)
            if mode == "off":
                procs = [
                    spawn(
                        args + ["--out", str(runs[k]), "--set", f"train.seed={k}"],
                        work / f"{runs[k].name}.log",
                    )
                    for k in range(2)
                ]
            else:
                g = ["--listen", "tcp://127.0.0.1:0", "--set", "gossip.wait_peers=1"]
                procs = [
                    spawn(
                        args + g + ["--out", str(runs[0]), "--set", "train.seed=0"],
                        work / f"{runs[0].name}.log",
                    )
                ]
                wait_for(lambda r0=runs[0]: status(r0).get("endpoint"), 60, "peer 0")
                ep = status(runs[0])["endpoint"]
                procs.append(
                    spawn(
                        args + g + ["--join", ep, "--out", str(runs[1]), "--set", "train.seed=1"],
                        work / f"{runs[1].name}.log",
                    )
                )
            cpu[mode].append(statistics.mean(cpu_seconds(procs)))
            times = []
            for run in runs:
                recs = records(run)[20:]  # after warm-up
                times.append(statistics.median(x["step_time_s"] for x in recs))
                if mode == "on":
                    c = status(run)["counters"]
                    exchanges.append(c.get("exchange.ok", 0) / sum(x["step_time_s"] for x in recs))
            results[mode].append(statistics.mean(times))
            print(
                f"  overhead repeat {r} {mode}: median step {results[mode][-1] * 1000:.1f} ms, "
                f"{cpu[mode][-1]:.1f} CPU s per process",
                flush=True,
            )
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    paired = [b / a for a, b in zip(results["off"], results["on"], strict=True)]
    cpu_paired = [b / a for a, b in zip(cpu["off"], cpu["on"], strict=True)]
    return {
        "cpu_s_per_process": cpu,  # whole run, start-up included (~2 s of imports)
        "cpu_paired_ratios": cpu_paired,
        "cpu_paired_ratio_median": statistics.median(cpu_paired),
        "step_s_off": off,
        "step_s_on": on,
        "ratio": on / off,
        "paired_ratios": paired,  # each repeat's two runs ran back to back: less drift
        "paired_ratio_median": statistics.median(paired),
        "exchanges_per_s_per_peer": statistics.mean(exchanges) if exchanges else 0.0,
        "runs": results,
    }


# ------------------------------------------------------------------ (b) throughput
def _peer_config(d_model: int, **gossip):
    from atom.config import load_config, replace

    cfg = load_config(None, [])
    return replace(
        cfg,
        model={"n_layer": 2, "d_model": d_model, "n_head": 4},
        train={"device": "cpu", "dtype": "fp32"},
        gossip={
            "listen": "tcp://127.0.0.1:0",
            "lanes": 0,  # only the exchanges we time: no lane of our own
            "strategy": "gossip",  # every exchange when asked (the outer ones wait H steps)
            "codec": "fp32",
            "heartbeat_s": 0.5,
            "dead_after_s": 5.0,
            "timeout_s": 60.0,
            **gossip,
        },
    )


def responder(out: Path, mbps: float, d_model: int, seconds: float) -> int:
    """A peer that only answers (no training, no exchanges of its own) until SIGINT."""
    from atom.gossip.merge import UnitParams
    from atom.gossip.peer import GossipPeer
    from atom.run.train import build_engine

    cfg = _peer_config(d_model, link_mbps=mbps, name="responder")
    engine = build_engine(cfg)
    peer = GossipPeer(cfg.gossip, UnitParams(engine.shared_units()), out, 0, 8)
    try:
        peer.start()
        peer.join()
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass
    finally:
        peer.close()
        engine.close()
    return 0


def bench_throughput(work: Path, rates: list[float], n_exchanges: int, d_model: int) -> list:
    from atom.gossip.merge import UnitParams
    from atom.gossip.peer import GossipPeer
    from atom.run.train import build_engine

    out = []
    for mbps in rates:
        run = work / f"throughput_{int(mbps)}"
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        args = ["_responder", "--work", str(run), "--mbps", str(mbps), "--d-model",
                str(d_model), "--seconds", "600"]  # fmt: skip
        proc = spawn(
            args, work / f"throughput_{int(mbps)}.log", [sys.executable, "-m", "tools.bench.gossip"]
        )
        try:
            wait_for(lambda run=run: status(run).get("ready"), 60, "responder")
            cfg = _peer_config(
                d_model, link_mbps=mbps, name="initiator", join=status(run)["endpoint"]
            )
            engine = build_engine(cfg)
            peer = GossipPeer(cfg.gossip, UnitParams(engine.shared_units()), None, 0, 8)
            peer.start()
            peer.join()
            partner = peer.table.get("responder")
            unit = max(peer.params.units, key=peer.params.numel)
            nbytes = 4 * peer.params.numel(unit)
            peer.averager.exchange(partner, unit)  # warm-up (connections, first allocation)
            t0 = time.monotonic()
            done = sum(peer.averager.exchange(partner, unit) for _ in range(n_exchanges))
            elapsed = time.monotonic() - t0
            peer.close()
            engine.close()
        finally:
            proc.send_signal(signal.SIGINT)
            finish([proc], 30)
        rate = mbps * 1e6 / 8
        got = 2 * nbytes * done / elapsed
        out.append(
            {
                "mbps": mbps,
                "unit_bytes": nbytes,
                "exchanges": done,
                "seconds": elapsed,
                "bytes_per_s": got,
                "ratio": got / rate,
            }
        )
        print(
            f"  throughput {mbps:g} Mb/s: {got * 8 / 1e6:.1f} Mb/s ({got / rate:.2f}x), "
            f"{done}/{n_exchanges} exchanges of {nbytes / 2**20:.2f} MiB",
            flush=True,
        )
    return out


# ------------------------------------------------------------------ (c) two sites
SITES = {"s0a": 0, "s0b": 0, "s1a": 1, "s1b": 1}


def run_sites(
    work: Path,
    selection: str,
    seconds: float,
    tag: str,
    inside: float,
    across: float,
    data: str,
    lanes: int,
):
    shards, union = prepare_data(work / "data")
    if data == "iid":  # every peer on the union: the sites differ only in their links
        shards = [union, union]
    runs = {n: work / f"sites_{tag}_{n}" for n in SITES}
    for run in runs.values():
        shutil.rmtree(run, ignore_errors=True)  # a stale gossip.json would point at nobody
    procs = {}
    for i, (name, site) in enumerate(SITES.items()):
        # one shared uplink to the other site, as a LAN behind one WAN link would have
        far = "+".join(o for o, s in SITES.items() if s != site) + f"={across:g}"
        args = MODEL + COMMON + [
            "--set", f"train.data={shards[site]}", "--set", f"train.seed={i}",
            "--set", "train.warmup_steps=20", "--max-steps", "1000000",
            "--set", "model.seq_len=64",
            "--listen", "tcp://127.0.0.1:0", "--set", f"gossip.name={name}",
            "--set", f"gossip.selection={selection}", "--set", "gossip.wait_peers=3",
            "--set", f"gossip.link_mbps={inside:g}", "--set", f"gossip.link_mbps_to={far}",
            "--set", "gossip.timeout_s=30", "--set", "gossip.join_timeout_s=120",
            "--set", f"gossip.lanes={lanes}",
            "--out", str(runs[name]),
        ]  # fmt: skip
        if i:
            args += ["--join", status(runs["s0a"])["endpoint"]]
        procs[name] = spawn(args, work / f"sites_{tag}_{name}.log")
        if not i:
            wait_for(lambda: status(runs["s0a"]).get("endpoint"), 60, "s0a")
    try:
        wait_for(
            lambda: all((r / "metrics.jsonl").exists() and records(r) for r in runs.values()),
            180,
            "all four peers training",
        )
        time.sleep(seconds)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGINT)
        finish(list(procs.values()), 60)
    names = list(SITES)
    mean_of = {
        "all": consensus([runs[n] for n in names]),
        "site0": consensus([runs["s0a"], runs["s0b"]]),
        "site1": consensus([runs["s1a"], runs["s1b"]]),
    }
    losses = {n: val_loss(runs[n], union) for n in names}
    steps = {n: records(runs[n])[-1]["step"] for n in names}
    exch_in = exch_across = 0
    for n in names:
        for row in status(runs[n]).get("peers", []):
            if row["id"] in SITES:
                if SITES[row["id"]] == SITES[n]:
                    exch_in += row["exchanges"]
                else:
                    exch_across += row["exchanges"]
    return {
        "selection": selection,
        "consensus": mean_of,
        "val_loss": statistics.mean(losses.values()),
        "val_losses": losses,
        "steps": steps,
        "exchanges_inside": exch_in,
        "exchanges_across": exch_across,
    }


def bench_sites(
    work: Path, seconds: float, repeats: int, data_modes: list[str], lanes: list[int]
) -> list[dict]:
    out = []
    for r in range(repeats):
        for n_lanes in lanes:
            for data in data_modes:
                for selection in ("flow", "random"):
                    tag = f"{data}_{selection}_l{n_lanes}_{r}"
                    res = run_sites(work, selection, seconds, tag, 1000, 20, data, n_lanes)
                    res.update(data=data, lanes=n_lanes, repeat=r)
                    out.append(res)
                    c = res["consensus"]
                    print(
                        f"  sites {data} {selection} lanes {n_lanes} #{r}: consensus "
                        f"{c['all']:.5f} (site0 {c['site0']:.5f}, site1 {c['site1']:.5f}), val "
                        f"loss {res['val_loss']:.4f}, exchanges inside {res['exchanges_inside']} "
                        f"across {res['exchanges_across']}, steps {res['steps']}",
                        flush=True,
                    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["overhead", "throughput", "sites", "all", "_responder"])
    ap.add_argument("--work", default="runs/bench_gossip", help="scratch directory")
    ap.add_argument("--steps", type=int, default=200, help="overhead: steps per run")
    ap.add_argument("--repeats", type=int, default=None, help="default: overhead 5, sites 2")
    ap.add_argument("--mbps", type=float, nargs="+", default=[20, 100, 1000])
    ap.add_argument("--exchanges", type=int, default=20, help="throughput: exchanges per rate")
    ap.add_argument("--d-model", type=int, default=512, help="throughput: model width")
    ap.add_argument("--seconds", type=float, default=60, help="sites: wall time per run")
    ap.add_argument(
        "--data",
        nargs="+",
        default=["sites", "iid"],
        choices=["sites", "iid"],
        help="sites: each site its own shard (no word in common) and/or every peer on both",
    )
    ap.add_argument(
        "--lanes", type=int, nargs="+", default=[1, 2], help="sites: gossip.lanes to compare"
    )
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_flush_denormal(True)
    if args.what == "_responder":  # a child of `throughput`
        return responder(work, args.mbps[0], args.d_model, args.seconds)
    report: dict = {}
    if args.what in ("overhead", "all"):
        report["overhead"] = bench_overhead(work, args.steps, args.repeats or 5)
        o = report["overhead"]
        print(
            f"overhead: {o['step_s_off'] * 1000:.1f} ms alone, {o['step_s_on'] * 1000:.1f} ms "
            f"with gossip: {o['ratio']:.3f}x; per repeat "
            f"{', '.join(f'{r:.3f}' for r in o['paired_ratios'])} (median "
            f"{o['paired_ratio_median']:.3f}x); CPU time {o['cpu_paired_ratio_median']:.3f}x; "
            f"{o['exchanges_per_s_per_peer']:.1f} exchanges/s per peer",
            flush=True,
        )
    if args.what in ("throughput", "all"):
        report["throughput"] = bench_throughput(work, args.mbps, args.exchanges, args.d_model)
    if args.what in ("sites", "all"):
        report["sites"] = bench_sites(work, args.seconds, args.repeats or 2, args.data, args.lanes)
    (work / f"report_{args.what}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {work / f'report_{args.what}.json'}")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
