"""atom vs GPipe pipeline parallel vs synchronous data parallel on kernel-shaped links.

    sudo .venv/bin/python -m tools.bench.vs_pipeline run --mbps 1000 100 20 5 --seconds 90
    .venv/bin/python -m tools.bench.vs_pipeline contention      # re-time the compute scale
    .venv/bin/python -m tools.bench.vs_pipeline report          # evaluate, tables, figures
    sudo .venv/bin/python -m tools.bench.vs_pipeline all --mbps 1000 100 20 5 --seconds 90

`run` needs root (it makes network namespaces with tools/net/shape.py). It

1. prepares the data (the stdlib corpus, byte tokens) and times the model's pieces on one
   thread with the profiler (profile.json: what `atom simulate` is fed for validation),
   and how much slower one trainer steps while N of them share the cores (the compute
   scale the simulator is given; `contention` re-measures it alone, without root);
2. trains a sync-SGD reference (one process, no network, batch = peers x micro_batch,
   --reference-steps steps): loss against tokens, to measure atom's convergence per token;
3. for every link rate: builds N namespaces on a bridge, every link i -> j shaped to the
   rate (htb), and runs each system for --seconds of training wall time:
     ddp       tools/baselines/ddp.py, one rank per namespace, gloo all-reduce
     pipeline  tools/baselines/pipeline.py, GPipe, one stage per namespace,
               --chunks micro-batches of peers x micro_batch / chunks sequences
     atom      `atom train --listen --join --insecure` in every namespace (gossip over the
               shaped links; each peer its own data seed), SIGINT after --seconds, with
               the outer optimizer (diloco, H 30, int8: tools/baselines/settings.py
               ATOM_VARIANTS)
     atom-avg  the same with plain fp32 averaging (the default, and what "atom" meant, in
               runs before 2026-11-25)
   All three train the same model from the same initial weights with the same AdamW,
   learning rate (constant after warm-up), clipping and tokens per step (peers x
   micro_batch sequences per optimizer step across the group). Snapshots are evaluated
   afterwards on one fixed validation set, so evaluation never costs training time.

`report` evaluates the snapshots, writes report.json, the markdown tables (measured, and
`atom simulate`'s prediction of the same runs with its error) and the figures
docs/bench_vs_pipeline_loss.png and docs/bench_vs_pipeline_throughput.png.

Every child runs with one thread (OMP_NUM_THREADS=1); every wait is bounded; every child
is stopped and every namespace deleted on the way out, also on failure or Ctrl+C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools import tool_env
from tools.baselines.settings import ATOM_ONLY, ATOM_VARIANTS, MODEL, TRAIN, overrides
from tools.bench.cpuload import ForeignLoad, wait_quiet
from tools.jsonl import read_records

log = logging.getLogger("bench_vs_pipeline")

SYSTEMS = ("ddp", "pipeline", *ATOM_VARIANTS)


def sets(d: dict) -> list[str]:
    return [a for k, v in d.items() for a in ("--set", f"{k}={v}")]


def child_env() -> dict[str, str]:
    return tool_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


# ------------------------------------------------------------------ preparation
def prepare(work: Path) -> Path:
    from atom.data.tokens import default_corpus

    data = default_corpus()
    (work / "data.txt").write_text(str(data))
    return data


def profile(work: Path, peers: int, chunks: int) -> dict:
    """One-thread piece times and host figures: what one uncontended process costs."""
    import torch

    from atom.config import load_config
    from atom.profiler import hardware, timing
    from atom.profiler.analysis import ModelAnalysis

    torch.set_num_threads(1)
    cfg = load_config(None, overrides())
    largest = ModelAnalysis.of(cfg).largest_unit
    hw = hardware.measure(torch.device("cpu"), largest, torch.float32)
    mb = cfg.train.micro_batch
    sizes = sorted({mb, peers * mb // chunks, peers * mb})
    pieces = {
        str(b): timing.measure_pieces(cfg.model, b, torch.device("cpu"), torch.float32, reps=15)
        for b in sizes
    }
    out = {
        "hardware": hw.to_dict(),
        "pieces": {k: vars(v) for k, v in pieces.items()},
        "threads": 1,
        "cores": os.cpu_count(),
    }
    (work / "profile.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def _solo_cmd(out: Path, data: Path, steps: int) -> list[str]:
    cfg = {**MODEL, **TRAIN, "swap.checkpoint": ATOM_ONLY["swap.checkpoint"],
           "train.eval_interval": 0, "train.ckpt_interval": 0, "train.data": data}  # fmt: skip
    return [sys.executable, "-m", "atom.cli", "train", "--no-progress", "--max-steps",
            str(steps), "--out", str(out)] + sets(cfg)  # fmt: skip


def _median_step(run: Path, skip: int) -> float:
    return statistics.median(r["step_time_s"] for r in read_records(run / "metrics.jsonl")[skip:])


def contention(work: Path, data: Path, peers: int, steps: int = 300) -> dict:
    """How much slower one atom trainer steps when `peers` of them share this machine's
    cores (no network, no gossip): the compute scale the simulator is fed when it is
    validated here. Assuming peers / cores ignores the trainers' extra threads and
    their contention for caches and memory."""
    base = work / "contention"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    timeout = steps * 2 + 120
    with open(base / "solo.log", "w") as f:
        subprocess.run(_solo_cmd(base / "solo", data, steps), stdout=f, stderr=subprocess.STDOUT,
                       env=child_env(), timeout=timeout, check=True)  # fmt: skip
    procs = []
    for i in range(peers):
        with open(base / f"shared{i}.log", "w") as f:
            procs.append(subprocess.Popen(_solo_cmd(base / f"shared{i}", data, steps), stdout=f,
                                          stderr=subprocess.STDOUT, env=child_env()))  # fmt: skip
    codes = _finish(procs, timeout * peers)
    if any(codes):
        raise RuntimeError(f"contention run failed: exit codes {codes} (logs in {base})")
    skip = steps // 10
    solo = _median_step(base / "solo", skip)
    shared = [_median_step(base / f"shared{i}", skip) for i in range(peers)]
    out = {"steps": steps, "solo_step_s": solo, "shared_step_s": shared,
           "compute_scale": statistics.mean(shared) / solo}  # fmt: skip
    log.info("%d trainers on %d cores: %.2fx the solo step (%.1f ms)", peers, os.cpu_count(),
             out["compute_scale"], solo * 1e3)  # fmt: skip
    return out


def measure_contention(work: Path, data: Path, peers: int, redo: bool = False) -> None:
    """Add the measured compute scale to profile.json (once, or again with redo)."""
    path = work / "profile.json"
    prof = json.loads(path.read_text())
    if "contention" in prof and not redo:
        return
    log.info("timing %d trainers sharing the cores (no network)", peers)
    prof["contention"] = contention(work, data, peers)
    path.write_text(json.dumps(prof, indent=1) + "\n")


def reference(work: Path, data: Path, peers: int, steps: int) -> Path:
    """Sync SGD at the group's batch, one process, no network: loss per token."""
    out = work / "reference"
    shutil.rmtree(out, ignore_errors=True)
    mb = peers * int(TRAIN["train.micro_batch"])
    cmd = [sys.executable, "-m", "tools.baselines.ddp", "--rank", "0", "--world", "1",
           "--master", "127.0.0.1:29499", "--out", str(out), "--seconds", "1e9",
           "--max-steps", str(steps), "--snapshot-steps", str(max(1, steps // 20)),
           "--data", str(data), "--set", f"train.micro_batch={mb}"]  # fmt: skip
    cmd += [a for o in overrides() if not o.startswith("train.micro_batch") for a in ("--set", o)]
    with open(work / "reference.log", "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                       timeout=steps * 5 + 120, check=True)  # fmt: skip
    return out


# ------------------------------------------------------------------ one system, one rate
def _finish(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not finish in time: killed", p.pid)
            p.kill()
            p.wait(10)
    return [p.returncode for p in procs]


def run_baseline(net, system: str, out: Path, data: Path, seconds: float, port: int,
                 chunks: int) -> list[int | None]:  # fmt: skip
    mb = int(TRAIN["train.micro_batch"])
    procs = []
    for r in range(net.n):
        cmd = [sys.executable, "-m", f"tools.baselines.{system}", "--rank", str(r),
               "--world", str(net.n), "--master", f"{net.ip(0)}:{port}", "--iface", "eth0",
               "--out", str(out), "--seconds", str(seconds), "--snapshot-s", str(seconds / 8),
               "--data", str(data)] + sets({**MODEL, **TRAIN})  # fmt: skip
        if system == "pipeline":
            cmd += ["--micro", str(net.n * mb // chunks), "--chunks", str(chunks)]
        log_file = open(out / f"rank{r}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(net.popen(r, cmd, stdout=log_file, stderr=subprocess.STDOUT,
                               env=child_env()))  # fmt: skip
        log_file.close()
    # start-up, the run, and one slow step (a 5 Mb/s all-reduce takes ~10 s) at most
    return _finish(procs, seconds + 240)


def _endpoint(run: Path) -> str | None:
    try:
        return json.loads((run / "gossip.json").read_text()).get("endpoint")
    except (OSError, json.JSONDecodeError):
        return None


def _wait(pred, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a peer exited while waiting for {what}")
        time.sleep(0.25)
    raise RuntimeError(f"timed out waiting for {what}")


def run_atom(net, out: Path, data: Path, seconds: float, port: int, ckpt_steps: int,
             variant: dict) -> list[int | None]:  # fmt: skip
    peers = [out / f"peer{i}" for i in range(net.n)]
    procs: list[subprocess.Popen] = []
    try:
        for i, run in enumerate(peers):
            cmd = [sys.executable, "-m", "atom.cli", "train", "--no-progress",
                   "--max-steps", "10000000", "--out", str(run), "--insecure",
                   "--listen", f"tcp://{net.ip(i)}:{port}"]  # fmt: skip
            cmd += sets({**MODEL, **TRAIN, **ATOM_ONLY, "train.data": data, "train.seed": i,
                         "train.ckpt_interval": ckpt_steps, "gossip.name": f"peer{i}",
                         **variant})  # fmt: skip
            if i:
                cmd += ["--join", f"tcp://{net.ip(0)}:{port}"]
            with open(out / f"peer{i}.log", "w") as f:
                procs.append(net.popen(i, cmd, stdout=f, stderr=subprocess.STDOUT,
                                       env=child_env()))  # fmt: skip
            if not i:
                _wait(lambda: _endpoint(peers[0]), 90, "peer 0 to listen", procs)

        def trained() -> float:
            return min(
                sum(r["step_time_s"] for r in read_records(p / "metrics.jsonl")) for p in peers
            )

        _wait(lambda: all(read_records(p / "metrics.jsonl") for p in peers), 240, "4 peers", procs)
        _wait(lambda: trained() >= seconds, seconds * 3 + 60, f"{seconds:g} s of training", procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)  # atom saves a checkpoint and exits
    return _finish(procs, 120)


def sweep(args: argparse.Namespace) -> None:
    from tools.net.shape import NetShape, available

    reason = available()
    if reason:
        raise SystemExit(f"bench_vs_pipeline run: {reason}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = prepare(work)
    if args.reprofile or not (work / "profile.json").exists():
        log.info("profiling the model's pieces on one thread")
        profile(work, args.peers, args.chunks)
    measure_contention(work, data, args.peers, args.reprofile)
    if args.reference_steps:
        log.info("sync-SGD reference: %d steps", args.reference_steps)
        reference(work, data, args.peers, args.reference_steps)
    index_path = work / "runs.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else []
    k = 0
    with NetShape(args.peers, args.mbps[0]) as net:
        for mbps in args.mbps:
            net.set_rates(mbps)
            for system in args.systems:
                k += 1
                out = work / f"{system}_{mbps:g}"
                done = [e for e in index if e["dir"] == out.name and _clean(e, args)]
                if done and not args.redo:
                    log.info("%s at %g Mb/s: kept from an earlier sweep (--redo)", system, mbps)
                    continue
                best: dict | None = None
                keep = out.with_name(out.name + ".best")
                for attempt in range(1, args.retries + 2):
                    before = wait_quiet(args.max_foreign, args.quiet_wait)
                    port = args.port + 10 * k + attempt
                    entry = one_run(args, net, system, mbps, out, data, port)
                    entry.update(attempt=attempt, foreign_before=before)
                    share = entry["foreign_cpu_share"]
                    prev = None if best is None else best["foreign_cpu_share"]
                    if best is None or prev is None or (share is not None and share < prev):
                        best = entry
                        shutil.rmtree(keep, ignore_errors=True)
                        shutil.copytree(out, keep)
                    if share is not None and share <= args.max_foreign:
                        break
                    log.warning("%s at %g Mb/s: other users took %s of the CPU%s", system, mbps,
                                "?" if share is None else f"{share:.0%}",
                                "; again" if attempt <= args.retries else "")  # fmt: skip
                if best is not None and best is not entry:  # the least disturbed attempt
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.copytree(keep, out)
                shutil.rmtree(keep, ignore_errors=True)
                index = [e for e in index if e["dir"] != out.name] + [best]
                index_path.write_text(json.dumps(index, indent=1) + "\n")
                log.info("%s at %g Mb/s: kept attempt %d (other users' CPU %s)", system, mbps,
                         best["attempt"], best["foreign_cpu_share"])  # fmt: skip


def _clean(entry: dict, args: argparse.Namespace) -> bool:
    share = entry.get("foreign_cpu_share")
    return (
        not entry.get("error")
        and entry.get("seconds") == args.seconds
        and share is not None
        and share <= args.max_foreign
    )


def one_run(args, net, system: str, mbps: float, out: Path, data: Path, port: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log.info("%s at %g Mb/s for %g s", system, mbps, args.seconds)
    t0 = time.monotonic()
    load = None
    try:
        with ForeignLoad() as load:
            if system in ATOM_VARIANTS:
                codes = run_atom(net, out, data, args.seconds, port, args.atom_ckpt,
                                 ATOM_VARIANTS[system])  # fmt: skip
            else:
                codes = run_baseline(net, system, out, data, args.seconds, port, args.chunks)
        error = None
    except RuntimeError as err:
        codes, error = [], str(err)
        log.error("%s at %g Mb/s failed: %s", system, mbps, err)
    net.stop_processes()
    share = None if error or load is None else load.share
    top = [] if error or load is None else load.top
    log.info("%s at %g Mb/s: exit codes %s (%.0f s), other users' CPU share %s %s", system,
             mbps, codes, time.monotonic() - t0, "-" if share is None else f"{share:.1%}",
             top)  # fmt: skip
    return {"system": system, "mbps": mbps, "dir": out.name, "seconds": args.seconds,
            "peers": args.peers, "chunks": args.chunks, "returncodes": codes, "error": error,
            "foreign_cpu_share": share, "foreign_top": top, "elapsed_s": time.monotonic() - t0,
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["run", "report", "all", "contention"])
    ap.add_argument("--work", default="runs/bench_vs_pipeline")
    ap.add_argument("--mbps", type=float, nargs="+", default=[1000, 100, 20, 5])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--seconds", type=float, default=90.0, help="training wall time per run")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=8, help="pipeline micro-batches per step")
    ap.add_argument("--atom-ckpt", type=int, default=100, help="atom: snapshot every N steps")
    ap.add_argument("--reference-steps", type=int, default=1000, help="0: skip the reference")
    ap.add_argument("--port", type=int, default=29600, help="first port (one per run)")
    ap.add_argument("--reprofile", action="store_true", help="re-time the pieces")
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        help="other users' CPU share above which a run is repeated (shared machine)",
    )
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=600,
        help="seconds to wait for a quiet machine before each run",
    )
    ap.add_argument("--retries", type=int, default=2, help="repeats of a disturbed run")
    ap.add_argument("--redo", action="store_true", help="re-run undisturbed runs in --work too")
    ap.add_argument("--docs", default="docs", help="where the figures go")
    ap.add_argument("--target", type=float, help="report: time to this val loss (default: "
                    "the lowest loss every atom run and the reference reached)")  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.what == "contention":  # no root needed: re-measure the compute scale alone
        work = Path(args.work)
        measure_contention(work, prepare(work), args.peers, redo=True)
    if args.what in ("run", "all"):
        sweep(args)
    if args.what in ("report", "all"):
        from tools.baselines.report import report

        report(Path(args.work), Path(args.docs), args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
