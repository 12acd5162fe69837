"""Helpers for the peer tests: datasets with distinct shards, `atom train` peers as child
processes on loopback, reading their status and checkpoints.

Every child is started with a bounded lifetime (--max-steps, and `stop_all` kills what is
left); tests/conftest.py also kills any child a test leaves behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from atom.data.tokens import prepare
from atom.store.checkpoint import load_checkpoint

# Three vocabularies with no word in common: a model trained on one shard alone has never
# seen the other shards' words, so mixing with peers shows up clearly in validation loss.
SHARD_WORDS = [
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split(),
    "north south east west river mountain valley forest desert ocean island harbor".split(),
    "red orange yellow green blue indigo violet black white grey brown pink".split(),
]

PEER_ARGS = [
    "--set", "model.n_layer=2",
    "--set", "model.d_model=64",
    "--set", "model.n_head=4",
    "--set", "model.seq_len=32",
    "--set", "train.micro_batch=8",
    "--set", "train.device=cpu",
    "--set", "train.dtype=fp32",
    "--set", "train.eval_interval=0",
    "--set", "train.eval_batches=4",
    "--set", "train.ckpt_interval=0",
    "--set", "train.warmup_steps=10",
    "--set", "gossip.heartbeat_s=0.25",
    "--set", "gossip.dead_after_s=1.5",
    "--set", "gossip.join_timeout_s=20",
    "--set", "gossip.interval_s=0.05",  # tiny model, short runs: mix often
    # plain fp32 averaging, exactly: the tests of the outer optimizer (the default) say so
    "--set", "gossip.strategy=gossip",
    "--set", "gossip.codec=fp32",
    "--no-progress",
]  # fmt: skip


def _lines(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(10)) for _ in range(n)]


def make_shards(root: Path, n_lines: int = 1500) -> tuple[list[Path], Path]:
    """Three shard datasets (disjoint vocabularies) and a union whose val split mixes all."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    texts = []
    for k, words in enumerate(SHARD_WORDS):
        lines = _lines(words, n_lines, k)
        texts.append(lines)
        src = root / f"shard{k}.txt"
        src.write_text("\n".join(lines))
        prepare([src], root / f"shard{k}", progress=False)
        shards.append(root / f"shard{k}")
    union = [line for group in zip(*texts, strict=True) for line in group]
    (root / "union.txt").write_text("\n".join(union))
    prepare([root / "union.txt"], root / "union", progress=False)
    return shards, root / "union"


def peer_cmd(out: Path, data: Path, steps: int, seed: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "atom.cli", "train", "--out", str(out), "--max-steps", str(steps),
        "--set", f"train.data={data}", "--set", f"train.seed={seed}", *PEER_ARGS, *extra,
    ]  # fmt: skip


def _default_sigint() -> None:
    # pytest run as a shell's background job ignores SIGINT and children would inherit
    # that; the peers are stopped with SIGINT (Ctrl+C), so they get the default back
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _peer_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=_peer_env(), preexec_fn=_default_sigint
        )


def start_in(net, node: int, cmd: list[str], log: Path) -> subprocess.Popen:
    """start(), inside node `node` of a tools.net.shape NetShape (stopped at its teardown)."""
    with open(log, "w") as f:
        return net.popen(node, cmd, stdout=f, stderr=subprocess.STDOUT, env=_peer_env())


def wait_for(predicate, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            if p.poll() is not None and p.returncode not in (0, None):
                raise AssertionError(f"a peer exited with {p.returncode} while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def status(run: Path) -> dict:
    try:
        return json.loads((Path(run) / "gossip.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def step_figures(run: Path, prefixes: tuple[str, ...], skip: int = 20) -> tuple[float, int, dict]:
    """A finished run's median step time (past the first `skip` steps: start-up), its
    number of records, and the counters in its gossip.json that start with `prefixes`."""
    recs = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    step = statistics.median(r["step_time_s"] for r in recs[skip:])
    counters = status(run).get("counters", {})
    return step, len(recs), {k: v for k, v in counters.items() if k.startswith(prefixes)}


def endpoint(run: Path, timeout: float = 60.0, procs=()) -> str:
    # (a peer's start is mostly importing torch: 20 s was overrun on a loaded 2-core box)
    wait_for(lambda: status(run).get("endpoint"), timeout, f"{run} to listen", procs)
    return status(run)["endpoint"]


def last_step(run: Path) -> int:
    path = Path(run) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:  # the tail only: a soak reads it every second for hours
            f.seek(max(0, f.seek(0, 2) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError):
            continue
    return 0


def stop_all(procs, timeout: float = 30.0) -> list[int]:
    """Wait for children to finish on their own; kill whatever overstays."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            codes.append(p.wait(5))
    return codes


def params(run: Path) -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(Path(run))
    return {n: ckpt.get(n) for n in ckpt.names() if not n.startswith("optim.")}


def flat(run: Path) -> torch.Tensor:
    p = params(run)
    return torch.cat([p[n].reshape(-1).float() for n in sorted(p)])


def consensus_distance(runs: list[Path]) -> float:
    """RMS distance of each peer's parameters from the peers' mean."""
    xs = torch.stack([flat(r) for r in runs])
    return float((xs - xs.mean(0)).pow(2).mean().sqrt())


def val_loss(run: Path, data: Path) -> float:
    """A finished run's checkpoint evaluated on another dataset's validation split: the
    same batches for every run (they are drawn by train.seed, which peers set apart)."""
    from atom.config import Config
    from atom.run.train import Trainer

    saved = json.loads((Path(run) / "config.json").read_text())
    saved["gossip"] = {}
    saved["train"]["data"] = str(data)
    saved["train"]["eval_batches"] = 16
    saved["train"]["seed"] = 0
    cfg = Config.from_dict(saved)
    trainer = Trainer(cfg, Path(run) / "eval", resident=True, resume=Path(run), progress=False)
    try:
        return trainer.evaluate()
    finally:
        trainer.engine.close()
