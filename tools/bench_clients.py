"""What client mode costs: a keyed group of 2 members + 2 clients against 4 members.

    python -m tools.bench_clients --steps 300 --rounds 2

Each peer is an `atom train` process on loopback (the peer tests' tiny GPT, a shard of
its own: disjoint vocabularies, so mixing shows in the val loss). The clients join with
--join and no --listen: nobody can dial them, they start every exchange themselves
(README "Over the internet"). Groups of each kind run one after the other, interleaved
over --rounds; all peers train --steps steps. Reported per kind: the mean val loss on the
union of the shards, the consensus distance of the final weights (RMS from the mean),
each client's exchanges made (gossip.json), and the peers any member declared dead or
penalised (their log lines). Issue 29 asks for the val loss within 3% of the 4 members'
and the consensus distance within 1.5x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import gossip_util as gu  # noqa: E402

LISTEN = ("--listen", "tcp://127.0.0.1:0")
DEATHS = ("stopped answering", "not choosing it for")  # a death, a penalty


def run_group(home: Path, shards: list[Path], union: Path, keys: Path, steps: int,
              clients: int) -> dict:  # fmt: skip
    """4 peers, the last `clients` of them without --listen; their run directories."""
    runs = [home / f"p{k}" for k in range(4)]
    common = ("--set", "gossip.strategy=gossip", "--set", "gossip.wait_peers=1")
    procs = [gu.start(gu.peer_cmd(runs[0], shards[0], steps, 1, *LISTEN, *common,
                                  "--group-key", str(keys / "p0")), home / "p0.log")]  # fmt: skip
    ep = gu.endpoint(runs[0], procs=procs)
    for k in range(1, 4):
        where = () if k >= 4 - clients else LISTEN
        cmd = gu.peer_cmd(runs[k], shards[k % len(shards)], steps, 1 + k, *where, *common,
                          "--join", ep, "--group-key", str(keys / f"p{k}"))  # fmt: skip
        procs.append(gu.start(cmd, home / f"p{k}.log"))
    codes = gu.stop_all(procs, timeout=60 + 2.0 * steps)
    logs = [(home / f"p{k}.log").read_text(errors="replace") for k in range(4)]
    status = [json.loads((r / "gossip.json").read_text()) for r in runs]
    return {
        "codes": codes,
        "val_loss": [gu.val_loss(r, union) for r in runs],
        "consensus": gu.consensus_distance(runs),
        "client_exchanges": [int(s["counters"].get("exchange.ok", 0))
                             for s in status[4 - clients :]],  # fmt: skip
        "modes": [s.get("mode") for s in status],
        "deaths_or_penalties": sum(line.count(d) for line in logs for d in DEATHS),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="atom-clients-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    shards, union = gu.make_shards(out / "data", n_lines=600)
    from atom.gossip.net.keys import keygen

    keygen(out / "keys", [f"p{k}" for k in range(4)])
    results: dict[int, list[dict]] = {0: [], 2: []}
    for r in range(args.rounds):
        for clients in (0, 2):  # interleaved: members, then with clients, each round
            home = out / f"round{r}-clients{clients}"
            home.mkdir()
            result = run_group(home, shards, union, out / "keys", args.steps, clients)
            results[clients].append(result)
            print(f"round {r}, {clients} clients: {json.dumps(results[clients][-1])}", flush=True)
    base_loss = statistics.mean(statistics.mean(x["val_loss"]) for x in results[0])
    base_cons = statistics.mean(x["consensus"] for x in results[0])
    loss = statistics.mean(statistics.mean(x["val_loss"]) for x in results[2])
    cons = statistics.mean(x["consensus"] for x in results[2])
    print(f"4 members: val loss {base_loss:.4f}, consensus {base_cons:.3g}")
    print(f"2 members + 2 clients: val loss {loss:.4f} ({loss / base_loss:.3f}x), consensus "
          f"{cons:.3g} ({cons / base_cons:.2f}x); client exchanges "
          f"{[x['client_exchanges'] for x in results[2]]}; modes "
          f"{[x['modes'] for x in results[2]]}; deaths or penalties "
          f"{[x['deaths_or_penalties'] for x in results[0] + results[2]]}")  # fmt: skip
    ok = all(c == 0 for x in results[0] + results[2] for c in x["codes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
