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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.adversary import honest_group  # noqa: E402


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
