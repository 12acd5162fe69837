"""What a poisoning member does to honest peers: 3 honest peers on disjoint shards,
trained together through gossip, with and without a 4th member that sends poison
(tests/adversary.py POISONS) and claims an averaging weight of 1e18. Reports each honest
peer's val loss on the union of the shards, the worst |weight| in their checkpoints, and
what they refused and clipped.

    python -m tools.bench_attacks poison [--modes flip,random,huge] [--steps 150]

Runs on loopback, each peer a child process (tests/gossip_util.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import gossip_util as gu  # noqa: E402

LISTEN = ("--listen", "tcp://127.0.0.1:0")


def honest_group(root: Path, steps: int, poison: str | None) -> dict:
    """Three honest peers (and, with `poison`, one poisoner) on loopback; their results."""
    shards, union = gu.make_shards(root)
    runs = [root / f"h{k}" for k in range(3)]
    common = ("--set", "gossip.wait_peers=2", "--set", "train.ckpt_interval=25")
    procs = [gu.start(gu.peer_cmd(runs[0], shards[0], steps, 1, *LISTEN, *common), root / "h0.log")]
    ep = gu.endpoint(runs[0], procs=procs)
    for k in (1, 2):
        cmd = gu.peer_cmd(runs[k], shards[k], steps, 1 + k, *LISTEN, "--join", ep, *common)
        procs.append(gu.start(cmd, root / f"h{k}.log"))
    bad = None
    if poison is not None:
        train = gu.peer_cmd(root / "p", shards[0], 10 * steps, 9, *LISTEN, "--join", ep,
                            "--set", "gossip.interval_s=0.01")[3:]  # fmt: skip
        cmd = [sys.executable, "-m", "tests.adversary", "poison", poison, "--", *train]
        bad = gu.start(cmd, root / "p.log")
    t0 = time.monotonic()
    codes = gu.stop_all(procs, timeout=180)
    wall = time.monotonic() - t0
    if bad is not None:
        bad.kill()
        bad.wait(10)
    losses = [gu.val_loss(r, union) for r in runs]
    worst = 0.0
    finite = True
    for r in runs:
        for ckpt in sorted((r / "checkpoints").glob("step_*")):
            for t in gu.params(ckpt).values():
                finite &= bool(torch.isfinite(t).all())
                worst = max(worst, float(t.abs().max()))
    counters = [gu.status(r).get("counters", {}) for r in runs]
    total = lambda key: int(sum(c.get(key, 0) for c in counters))  # noqa: E731
    return {
        "codes": codes,
        "val_loss": losses,
        "mean_val_loss": sum(losses) / 3,
        "max_abs_weight": worst,
        "finite": finite,
        "refused": total("rejected.outlier") + total("rejected.nonfinite"),
        "served_refused": total("served.refused"),
        "wall_s": wall,
    }


def cmd_poison(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in [None, *args.modes.split(",")]:
            root = Path(tmp) / (mode or "clean")
            root.mkdir()
            result = honest_group(root, args.steps, mode)
            result["mode"] = mode or "none"
            rows.append(result)
            print(json.dumps(result), flush=True)
    base = rows[0]["mean_val_loss"]
    print("\n| poisoner | honest val loss (mean) | vs none | max abs weight | finite | refused |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["val_loss"])
        print(f"| {r['mode']} | {r['mean_val_loss']:.3f} ({each}) "
              f"| {r['mean_val_loss'] / base:.3f}x | {r['max_abs_weight']:.3g} | {r['finite']} "
              f"| {r['refused']} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("poison", help="honest val loss with and without a poisoning member")
    p.add_argument("--modes", default="flip,random,huge")
    p.add_argument("--steps", type=int, default=150)
    p.set_defaults(func=cmd_poison)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
