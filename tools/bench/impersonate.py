"""Impersonation in a keyed group, measured (issue 41): `attacks impersonate`.

    python -m tools.bench.attacks impersonate [--steps 200] [--repeats 3] [--own-server]

Three honest members of a keyed group (alice, bob, dave: `atom train --group-key`, each
its own process, disjoint shards) train with and without an impostor: mallory, a member
with her own valid bundle (a script: tests/adversary.py's Adversary over her key). She
pings as a client (listening nowhere in her own name, so the honest members' exchanges
are among themselves, as in the clean run; `--own-server`: a server of hers answers as
herself too, a partner that echoes the asker's weights and so never mixes). She runs
servers under names she does not own, each with the group's keypair (every bundle holds
it) and with her own:

    carol  allow-listed, never running
    zed    not on the allow-list
    dave   an honest member (h2), who joins last: she names him before he is there

and every 0.1 s pings each honest member with a peer list naming them at those servers
(alternating the two keys), plus pings sent as carol, zed and dave over her own key. Each
attacked run sits beside a clean run of the same group (interleaved, repeated).

What is measured, read from each honest member's gossip.json every 0.1 s and from the
impostor's servers: exchanges completed with a faked name at the impostor's address,
how often a faked name was listed (alive) there, or only held as a hint (an
introduction, never dialled as alive nor listed), the messages that reached the
impostor's servers at all (a connection that completes its handshake there is the
failure), the pings refused as sent in another's name (`rejected.identity`), whether
alice and bob have dave at his own address at the end, and the members' val loss on
the union of the shards against the clean runs'.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

from tools.bench.attack_runs import fingerprint, interleaved

FAKES = ("carol", "zed", "dave")
MALLORY = "mallory"


def _rec(pid: str, ep: str) -> dict:
    return {"id": pid, "ep": ep, "inc": 1, "step": 0, "ready": True}


class Impostor:
    """mallory's servers (tests/test_gossip_identity.py's impostor: answers every ping as
    whoever it is asked for, every exchange with the asker's own weights) and her pings."""

    def __init__(self, keys: Path, own_server: bool = False):
        import zmq
        import zmq.auth

        from tests.test_gossip_identity import _impostor

        self.keys, self.ctx = keys, zmq.Context()
        group = zmq.auth.load_certificate(str(keys / "group.key_secret"))
        own = zmq.auth.load_certificate(str(keys / MALLORY / f"{MALLORY}.key_secret"))
        self.seen: dict[str, list] = {}  # server -> the names messages reaching it were for
        self.servers: dict[str, tuple] = {}  # "carol/group" -> (ep, stop, thread)
        for name in (*FAKES, MALLORY):
            for which, pair in (("group", group), ("own", own)):
                if name == MALLORY and (which == "group" or not own_server):
                    continue  # her own name: served with her own key, as a member does
                label = f"{name}/{which}"
                self.seen[label] = []
                self.servers[label] = _impostor(self.ctx, pair, name, self.seen[label])
        # her own endpoint: "" (a client: nobody dials her, so the honest members' exchanges
        # are among themselves, as in the clean run), or her server answering as herself
        self.own_ep = self.servers[f"{MALLORY}/own"][0] if own_server else ""
        self.advs: dict[str, object] = {}  # honest run name -> Adversary over her key
        self.pings = self.in_names = 0
        self.error = ""

    def ep(self, label: str) -> str:
        return self.servers[label][0]

    @property
    def fake_eps(self) -> set[str]:
        return {v[0] for k, v in self.servers.items() if not k.startswith(MALLORY)}

    def run(self, runs: list[Path], stop: threading.Event) -> None:
        """Until stop: introduce the fakes to every honest member that listens."""
        try:
            self._run(runs, stop)
        except BaseException as err:  # a bench whose impostor died measures nothing
            self.error = repr(err)
            raise

    def _run(self, runs: list[Path], stop: threading.Event) -> None:
        import zmq

        from tests import gossip_util as gu
        from tests.adversary import Adversary

        fp = None
        k = 0
        while not stop.is_set():
            k += 1
            for run in runs:
                st = gu.status(run)
                if (
                    run.name not in self.advs
                    and st.get("endpoint")
                    and (run / "config.json").exists()
                ):
                    try:  # config.json may be half-written yet: again next round
                        fp = fp or fingerprint(run)
                        self.advs[run.name] = Adversary(st["endpoint"], st["group"], fp,
                                                        bundle=self.keys / MALLORY,
                                                        name=MALLORY)  # fmt: skip
                    except (ValueError, TypeError, zmq.ZMQError):  # or its owner not found
                        continue
                adv = self.advs.get(run.name)
                if adv is None or st.get("state") != "running":
                    continue  # not yet, or it stopped: nothing it could count
                which = "group" if k % 2 else "own"
                listed = [_rec(n, self.ep(f"{n}/{which}")) for n in FAKES]
                h = adv.header("ping", to=adv.server, ep=self.own_ep,
                               peers=listed, links=[])  # fmt: skip
                adv.send_raw(adv.frames(h))
                self.pings += 1
                for n in FAKES:  # in the fakes' own names, over her key: refused
                    h = adv.header("ping", to=adv.server, ep=self.ep(f"{n}/{which}"),
                                   peers=[], links=[], **{"from": n})  # fmt: skip
                    adv.send_raw(adv.frames(h))
                    self.in_names += 1
                while adv.sock.poll(0):  # the pongs: read, not kept
                    adv.sock.recv_multipart()
            stop.wait(0.1)

    def close(self) -> dict:
        for adv in self.advs.values():
            adv.close()
        for _, ev, thread in self.servers.values():
            ev.set()
            thread.join(5)
        self.ctx.term()
        if self.error:
            raise RuntimeError(f"the impostor stopped: {self.error}")
        return {"pings": self.pings, "pings_in_their_names": self.in_names,
                "reached": {k: len(v) for k, v in self.seen.items()}}  # fmt: skip


class Watch:
    """What the honest members say of the fakes (their gossip.json, every 0.1 s)."""

    def __init__(self, runs: list[Path], fake_eps: set[str]):
        self.runs, self.fake_eps = runs, fake_eps
        self.samples = self.alive = self.listed = self.hints = self.exchanges = 0

    def look(self) -> None:
        from tests import gossip_util as gu

        self.samples += 1
        for run in self.runs:
            for row in gu.status(run).get("peers", []):
                if row["id"] not in FAKES or row["endpoint"] not in self.fake_eps:
                    continue
                self.hints += row["status"] != "alive"
                self.alive += row["status"] == "alive"
                self.listed += row["status"] == "alive" and row["reachable"] is True
                self.exchanges = max(self.exchanges, row.get("exchanges", 0))

    def dave_at_home(self) -> list[bool]:
        """Do alice and bob have dave at his own address (the last gossip.json)?"""
        from tests import gossip_util as gu

        home = gu.status(self.runs[2]).get("endpoint")
        rows = [{r["id"]: r for r in gu.status(run).get("peers", [])} for run in self.runs[:2]]
        return [r.get("dave", {}).get("endpoint") == home for r in rows]


def impersonated_group(root: Path, steps: int, attacked: bool, own_server: bool = False) -> dict:
    """The keyed group (tests/adversary.py honest_group), with or without mallory."""
    from atom.gossip.net.keys import keygen
    from tests import gossip_util as gu
    from tests.adversary import KEYED, honest_group

    keygen(root / "keys", [*KEYED, "carol", MALLORY])  # carol: allow-listed, absent
    out: dict = {}

    def during(procs, runs) -> None:
        imp = Impostor(root / "keys", own_server) if attacked else None
        watch = Watch(runs, imp.fake_eps if imp else set())
        stop = threading.Event()
        thread = None
        if imp is not None:
            thread = threading.Thread(target=imp.run, args=(runs, stop), daemon=True)
            thread.start()
        try:
            while any(p.poll() is None for p in procs):
                watch.look()
                time.sleep(0.1)
        finally:
            stop.set()
            if thread is not None:
                thread.join(30)
            out.update(impostor=imp.close() if imp else {}, samples=watch.samples,
                       alive=watch.alive, listed=watch.listed, hints=watch.hints,
                       exchanges=watch.exchanges, dave_at_home=watch.dave_at_home())  # fmt: skip
        counters = [gu.status(r).get("counters", {}) for r in runs]
        out["identity_refused"] = int(sum(c.get("rejected.identity", 0) for c in counters))
        out["rejected"] = {k: int(sum(c.get(k, 0) for c in counters))
                           for k in sorted({k for c in counters for k in c})
                           if k.startswith(("rejected.", "auth."))}  # fmt: skip

    result = honest_group(root, steps, None, keys=root / "keys", during=during)
    result.update(out)
    return result


def cmd_impersonate(args) -> None:
    run = lambda root, attacked: impersonated_group(root, args.steps, attacked, args.own_server)  # noqa: E731
    rows = interleaved(args.repeats, run)
    base = statistics.mean(r["mean_val_loss"] for r in rows if not r["attacked"])
    print(
        "\n| run | honest val loss: mean (alice, bob, dave) | vs clean | exchanges with a "
        "faked name there | alive there | a hint there | messages at its fake servers "
        "| pings refused as another's | dave at home (alice, bob) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["val_loss"])
        imp = r.get("impostor") or {}
        fake = sum(v for k, v in imp.get("reached", {}).items() if not k.startswith(MALLORY))
        hints = f"{r['hints']} rows in {r['samples']} looks" if r["attacked"] else "-"
        print(f"| {'impostor' if r['attacked'] else 'clean'} | {r['mean_val_loss']:.3f} "
              f"({each}) | {r['mean_val_loss'] / base:.3f}x "
              f"| {r['exchanges'] if r['attacked'] else '-'} "
              f"| {r['alive'] if r['attacked'] else '-'} | {hints} "
              f"| {fake if r['attacked'] else '-'} "
              f"| {r['identity_refused']} of {imp.get('pings_in_their_names', 0)} "
              f"| {r['dave_at_home']} |")  # fmt: skip
