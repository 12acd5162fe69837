"""Attacks on a peer, measured (tests/adversary.py speaks the real protocol).

    python -m tools.bench.attacks poison [--modes flip,random,huge] [--steps 150]
        [--honest-set gossip.clip_factor=0]  (the honest peers' own settings)
    python -m tools.bench.attacks resources [--attacks ids,pulls,endless] [--repeats 2]
    python -m tools.bench.attacks takeover [--ids 5] [--steps 150] [--repeats 2]
    python -m tools.bench.attacks dialer [--ids 5] [--steps 600] [--repeats 2]
    python -m tools.bench.attacks impersonate [--steps 200] [--repeats 3]

poison     3 honest peers on disjoint shards, trained together through gossip, with and
           without a 4th member that sends poison (POISONS) and claims an averaging
           weight of 1e18: each honest peer's val loss on the union of the shards, the
           worst |weight| in their checkpoints, and how many messages they refused.
resources  one training peer (`atom train`, gossip listening) under each attack for its
           whole run, against the same run unattacked (interleaved, repeated): median
           step time and the growth of its resident memory from before the attack.
           ids: 15,000 fake peer ids introduced plus 100 ids pinging directly;
           pulls: state pulls as fast as one client sends them (up to 10,000/s);
           endless: one multipart message that never ends (raw ZMTP), reconnecting.
takeover   3 honest peers, as in poison, with and without an attacker (no peer of its
           own: a script) that sends exchange requests for every unit carrying zeros,
           weight 1e18, from --ids invented ids in turn, as fast as the first peer answers
           (a member was zeroed in 2 s that way before the serve budget,
           atom/gossip/budget.py): each honest peer's val loss, the exchanges the victim
           served the attacker, and what its budget refused.
dialer     the same group, the attacker pinging the first peer every 0.1 s with a peer
           list naming 200 endpoints (listeners counting every connection made to them)
           under ever new names, and --ids pings in invented names 'at' them: the
           connections it caused, per minute (a ping like it once made a member open
           ~1,000 a second).
impersonate  3 keyed honest members, with and without a keyed impostor serving under
           names it does not own (carol: allow-listed, absent; zed: no key; dave: an
           honest member's): exchanges completed with those names, whether a member ever
           lists them at the impostor's servers, and val loss (tools/bench/impersonate.py).

Runs on loopback, each peer a child process (tests/gossip_util.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.adversary import honest_group  # noqa: E402
from tools.bench import impersonate  # noqa: E402
from tools.bench.attack_runs import fingerprint, interleaved  # noqa: E402


def cmd_poison(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in [None, *args.modes.split(",")]:
            root = Path(tmp) / (mode or "clean")
            root.mkdir()
            honest = tuple(x for kv in args.honest_set for x in ("--set", kv))
            result = honest_group(root, args.steps, mode, honest)
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


# ------------------------------------------------------------------ resources
STEPS_MODEL = ["--set", "model.n_layer=4", "--set", "model.d_model=128", "--set", "model.n_head=4"]


def _victim(run: Path, timeout: float = 120, procs=()) -> dict:
    """The victim's status once it listens and has written its config (what an attacker
    needs of it: endpoint, name, group; the fingerprint from the config)."""
    from tests import gossip_util as gu

    gu.wait_for(lambda: gu.status(run).get("endpoint") and (run / "config.json").exists(),
                timeout, "the victim", procs)  # fmt: skip
    return gu.status(run)


def _attack_ids(adv, stop) -> None:
    from tests.adversary import Adversary

    fake = [{"id": f"fake{k}", "ep": f"tcp://10.9.{k // 250}.{k % 250 + 1}:9", "inc": k,
             "step": 0, "ready": True} for k in range(15_000)]  # fmt: skip
    for k in range(0, len(fake), 250):
        h = adv.header("ping", to=adv.victim, **{"from": f"loud{k // 250}"})
        h.update(peers=fake[k : k + 250], links=[])
        adv.send_raw(adv.frames(h))
    louds = [Adversary(adv.endpoint, adv.group, adv.fingerprint, name=f"loud{k}")
             for k in range(100)]  # fmt: skip
    try:
        while not stop.is_set():
            for a in louds:
                h = a.header("ping", to=adv.victim)
                h.update(peers=[], links=[])
                a.send_raw(a.frames(h))
            stop.wait(0.5)
    finally:
        for a in louds:
            a.close()


def _attack_pulls(adv, stop) -> None:
    import zmq

    sent, t0 = 0, time.monotonic()
    while not stop.is_set():
        h = adv.header("sreq", to=adv.victim, unit=sent % 2, **{"from": f"p{sent % 50}"})
        try:
            adv.sock.send_multipart(adv.frames(h), zmq.NOBLOCK)
        except zmq.Again:
            pass
        sent += 1
        while adv.sock.poll(0):
            adv.sock.recv_multipart()
        ahead = sent / 10_000 - (time.monotonic() - t0)  # at most 10k a second
        if ahead > 0:
            time.sleep(ahead)


def _attack_endless(adv, stop) -> None:
    while not stop.is_set():
        try:
            adv.endless_zmtp(1 << 20, 30.0, 1 << 40)
        except OSError:
            stop.wait(0.05)


ATTACKS = {"ids": _attack_ids, "pulls": _attack_pulls, "endless": _attack_endless}


def attacked_run(work: Path, data: Path, steps: int, attack: str | None) -> dict:
    import psutil

    from tests import gossip_util as gu
    from tests.adversary import Adversary

    run = work / f"victim_{attack or 'none'}"
    args = gu.peer_cmd(run, data, steps, 1, "--listen", "tcp://127.0.0.1:0", *STEPS_MODEL,
                       "--set", "train.eval_interval=0")  # fmt: skip
    proc = gu.start(args, work / f"{run.name}.log")
    peak = base = 0
    try:
        victim = _victim(run, 60, [proc])
        child = psutil.Process(proc.pid)
        base = child.memory_info().rss
        stop = threading.Event()
        thread = None
        if attack is not None:
            adv = Adversary(victim["endpoint"], victim["group"], fingerprint(run))
            adv.victim = victim["id"]
            thread = threading.Thread(target=ATTACKS[attack], args=(adv, stop), daemon=True)
            thread.start()
        while proc.poll() is None:
            try:
                peak = max(peak, child.memory_info().rss - base)
            except psutil.Error:
                break
            time.sleep(0.02)
        stop.set()
        if thread is not None:
            thread.join(10)
            adv.close()
    finally:
        gu.stop_all([proc], timeout=60)
    step, steps, counted = gu.step_figures(run, ("rejected", "guard", "server"))
    return {"attack": attack or "none", "code": proc.returncode, "step_s": step,
            "rss_growth_mb": peak / 2**20, "steps": steps, "counters": counted}  # fmt: skip


# ------------------------------------------------------------------ takeover
def _takeover(root: Path, n_ids: int, stop: threading.Event, out: dict) -> None:
    """Wait for h0, then send it zeros in exchange requests from n_ids ids until stop."""
    import numpy as np

    from tests.adversary import Adversary

    run = root / "h0"
    victim = _victim(run)
    sizes = _unit_sizes(run)
    adv = Adversary(victim["endpoint"], victim["group"], fingerprint(run))
    sent = served = 0
    try:
        while not stop.is_set():
            for unit, n in sizes.items():
                h = adv.exchange_header(victim["id"], unit, n, weight=1e18,
                                        **{"from": f"sybil{sent % n_ids}"})  # fmt: skip
                sent += 1
                reply = adv.request(h, np.zeros(n, np.float32), timeout=1.0)
                served += reply is not None and reply.get("kind") == "xrep"
    finally:
        adv.close()
        out.update(sent=sent, served=served)


def _unit_sizes(run: Path) -> dict[int, int]:
    from atom.config import Config
    from atom.gossip.merge import UnitParams
    from atom.run.train import build_engine

    engine = build_engine(Config.from_dict(json.loads((run / "config.json").read_text())))
    try:
        params = UnitParams(engine.shared_units())
        return {u: params.numel(u) for u in params.units}
    finally:
        engine.close()


def _dialer(root: Path, n_ids: int, stop: threading.Event, out: dict) -> None:
    """Wait for h0, then ping it, over and over, with peer lists naming 200 endpoints that
    count every connection made to them (listeners on loopback), under ever new names, and
    pings in invented names 'at' them: every connection they count was dialled on the
    attacker's word."""
    from tests.adversary import Adversary
    from tests.test_gossip_identity import CountingListeners

    run = root / "h0"
    victim = _victim(run)
    listeners = CountingListeners(200)
    eps = listeners.endpoints
    adv = Adversary(victim["endpoint"], victim["group"], fingerprint(run))
    t0, k = time.monotonic(), 0
    try:
        while not stop.is_set():
            k += 1
            listed = [{"id": f"n{k}x{j}", "ep": eps[(k + j) % len(eps)], "inc": 1, "step": 0,
                       "ready": True} for j in range(200)]  # fmt: skip
            h = adv.header("ping", to=victim["id"], ep=eps[k % len(eps)], peers=listed, links=[])
            adv.send_raw(adv.frames(h))
            for j in range(n_ids):
                fake = adv.header("ping", to=victim["id"], ep=eps[(7 * k + j) % len(eps)],
                                  peers=[], links=[], **{"from": f"s{k}x{j}"})  # fmt: skip
                adv.send_raw(adv.frames(fake))
            stop.wait(0.1)
    finally:
        adv.close()
        minutes = (time.monotonic() - t0) / 60
        out.update(attempts=listeners.accepts, per_minute=listeners.accepts / minutes,
                   messages=k * (1 + n_ids))  # fmt: skip
        listeners.close()


ATTACKERS = {"takeover": _takeover, "dialer": _dialer}


def cmd_group(args: argparse.Namespace) -> None:
    """takeover, dialer: the honest group with and without the attacker, interleaved."""

    def run(root: Path, attacked: bool) -> dict:
        stop, out = threading.Event(), {}
        attack = ATTACKERS[args.command]
        thread = threading.Thread(target=attack, args=(root, args.ids, stop, out), daemon=True)
        if attacked:
            thread.start()
        result = honest_group(root, args.steps, None)
        stop.set()
        if attacked:
            thread.join(30)
        result.update(attack=out)
        return result

    rows = interleaved(args.repeats, run)
    clean = [r for r in rows if not r["attacked"]]
    base = statistics.mean(r["mean_val_loss"] for r in clean)
    print("\n| attacker | honest val loss (mean; each) | vs none | victim's | attack |")
    print("|---|---|---|---|---|")
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["val_loss"])
        att = r["attack"]
        what = (f"{att.get('served', '-')} served / {att.get('sent', '-')} sent"
                if args.command == "takeover" else
                f"{att.get('attempts', '-')} dials ({att.get('per_minute', 0):.1f} a minute) "
                f"on {att.get('messages', '-')} messages")  # fmt: skip
        print(f"| {args.command if r['attacked'] else 'none'} | {r['mean_val_loss']:.3f} "
              f"({each}) | {r['mean_val_loss'] / base:.3f}x | {r['val_loss'][0] / base:.3f}x "
              f"| {what if r['attacked'] else '-'} |")  # fmt: skip


def cmd_resources(args: argparse.Namespace) -> None:
    from tests import gossip_util as gu

    attacks = args.attacks.split(",")
    rows: dict[str, list[dict]] = {a: [] for a in ["none", *attacks]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shards, _ = gu.make_shards(work)
        for r in range(args.repeats):
            for attack in [None, *attacks]:  # each attack beside an unattacked run
                sub = work / f"r{r}"
                sub.mkdir(exist_ok=True)
                result = attacked_run(sub, shards[0], args.steps, attack)
                rows[result["attack"]].append(result)
                print(json.dumps(result), flush=True)
    base = statistics.median(x["step_s"] for x in rows["none"])
    print("\n| attack | median step (ms) | vs none | RSS growth (MB) | exit | counted |")
    print("|---|---|---|---|---|---|")
    for attack, results in rows.items():
        steps = [x["step_s"] for x in results]
        grow = max(x["rss_growth_mb"] for x in results)
        counted = ", ".join(f"{k} {int(v)}" for k, v in results[-1]["counters"].items())
        print(f"| {attack} | {1000 * statistics.median(steps):.1f} "
              f"({', '.join(f'{1000 * s:.1f}' for s in steps)}) "
              f"| {statistics.median(steps) / base:.2f}x | {grow:.0f} "
              f"| {[x['code'] for x in results]} | {counted or '-'} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("poison", help="honest val loss with and without a poisoning member")
    p.add_argument("--modes", default="flip,random,huge")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--honest-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for the honest peers, e.g. gossip.clip_factor=0")  # fmt: skip
    p.set_defaults(func=cmd_poison)
    p = sub.add_parser("resources", help="step time and memory of a peer under attack")
    p.add_argument("--attacks", default="ids,pulls,endless")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=2)
    p.set_defaults(func=cmd_resources)
    for name, what, steps in (
        ("takeover", "sybil exchange requests", 150),
        ("dialer", "peer lists of dead endpoints", 600),
    ):
        p = sub.add_parser(name, help=f"honest val loss with and without {what}")
        p.add_argument("--ids", type=int, default=5)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--repeats", type=int, default=2)
        p.set_defaults(func=cmd_group)
    p = sub.add_parser("impersonate", help="a keyed impostor serving under others' names")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--own-server", action="store_true", help="she serves as herself too")
    p.set_defaults(func=impersonate.cmd_impersonate)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
