"""Attacks by a scripted peer speaking the real protocol (tests/adversary.py): forged
goodbyes and moves, replays, misdirected messages, a member speaking as another, an
unfinished multipart message. Each asserts what the honest peer keeps.

pytest tests/test_adversary.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from atom.gossip.net.keys import keygen
from tests.adversary import Adversary, ConnectionFlood
from tests.test_gossip_peers import group, wait_until, weights  # noqa: F401 (fixture)


@pytest.fixture
def adversary():
    made = []

    def make(peer, **kw):
        adv = Adversary(peer.endpoint, peer.group, peer.params.fingerprint, **kw)
        made.append(adv)
        return adv

    yield make
    for adv in made:
        adv.close()


def _pair(group, **gossip):  # noqa: F811
    a = group("a", seed=1, **gossip)
    b = group("b", seed=2, join=a.endpoint, **gossip)
    wait_until(lambda: a.table.get("b") is not None and a.table.get("b").status == "alive")
    return a, b


def test_a_forged_goodbye_changes_nothing(group, adversary):  # noqa: F811
    """A bye in b's name (its id, endpoint and incarnation are public: every heartbeat
    lists them) only makes a ask b; b answers from its endpoint and stays."""
    a, b = _pair(group)
    adv = adversary(a)
    # twice (a second one used to find b "leaving" and tombstone it), with rids far above
    # b's own (a sliding window once refused every honest rid of b's after that)
    for rid in (2**50, 2**62):
        h = adv.header("bye", to="a", inc=b.incarnation, ep=b.endpoint, rid=rid, **{"from": "b"})
        adv.request(h)
    wait_until(lambda: a.table.forged >= 1, 5, "the goodbye refuted by b itself")
    wait_until(lambda: a.table.get("b").status == "alive", 5, "b alive again")
    p = a.table.get("b")
    assert p.incarnation == b.incarnation and "b" not in a.table.tombstones
    before = b.counters.get("exchange.ok")  # exchanges b starts: a still serves b's rids
    wait_until(lambda: b.counters.get("exchange.ok") > before + 2, 10, "b served by a")


def test_forged_goodbyes_cost_a_live_peer_nothing(group, adversary):  # noqa: F811
    """Goodbyes forged in b's name every 0.1 s, each with a ping claiming b moved to a
    dead endpoint (a's heartbeat then waits its full timeout there): b used to be
    "leaving" nearly all the time, and a made 1-2 exchanges with it in 10 s instead of
    11-39. b has answered a's pings, so now it stays a partner while a checks."""
    a, b = _pair(group, interval_s=0.05)
    adv = adversary(a)

    def exchanges() -> int:
        return a.table.get("b").exchanges

    start = exchanges()
    time.sleep(3.0)
    clean = exchanges() - start
    start, seen = exchanges(), set()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        forged = {"from": "b", "inc": b.incarnation}
        adv.send_raw(adv.frames(adv.header("bye", to="a", ep=b.endpoint, **forged)))
        ping = adv.header("ping", to="a", ep="tcp://127.0.0.1:9", **forged)
        ping.update(peers=[], links=[])
        adv.send_raw(adv.frames(ping))
        for _ in range(10):
            p = a.table.get("b")
            seen.add((p.status, p.ready))
            time.sleep(0.01)
    attacked = exchanges() - start
    print(f"exchanges with b in 3 s: {attacked} under attack, {clean} without")  # -s shows
    assert seen == {("alive", True)}
    assert clean > 0 and attacked >= 0.7 * clean, (attacked, clean)
    assert a.table.forged >= 1 and "b" not in a.table.tombstones


def test_a_forged_move_changes_nothing(group, adversary):  # noqa: F811
    """A ping in b's name with a new incarnation and a dead endpoint used to move b there
    (partitioned for good). Now it is a claim a checks itself, and b stays put."""
    a, b = _pair(group)
    adv = adversary(a)
    for _ in range(5):
        h = adv.header("ping", to="a", inc=12345, ep="tcp://127.0.0.1:1", **{"from": "b"})
        h.update(peers=[], links=[])
        adv.request(h, timeout=0.3)
    time.sleep(2 * a.cfg.dead_after_s)  # the claim is pinged, never proven, forgotten
    p = a.table.get("b")
    assert (p.endpoint, p.incarnation, p.status) == (b.endpoint, b.incarnation, "alive")
    assert a.table.unproven() == []
    before = a.counters.get("exchange.ok") + a.counters.get("served.ok")
    wait_until(lambda: a.counters.get("exchange.ok") + a.counters.get("served.ok") > before + 2)


def test_a_replayed_exchange_is_merged_once(group, adversary):  # noqa: F811
    a = group("a", seed=1, interval_s=60.0)  # a initiates nothing: only mallory's exchange
    adv = adversary(a)
    n = a.params.numel(1)
    theirs = a.params.snapshot(1).numpy() + np.float32(1e-3)
    frames = adv.frames(adv.exchange_header("a", 1, n), theirs)
    adv.send_raw(frames)
    wait_until(lambda: a.counters.get("served.ok") == 1, 5, "the exchange served")
    after_one = weights(a)
    for _ in range(4):
        adv.send_raw(frames)
    wait_until(lambda: a.counters.get("rejected.replay") == 4, 5, "replays refused")
    assert a.counters.get("served.ok") == 1 and bool((weights(a) == after_one).all())
    assert not a.table.penalised("mallory")  # not proof of who sent it


def test_forged_pings_cannot_spend_a_peers_request_ids(group, adversary):  # noqa: F811
    """A peer's pings show the rid it just used. When rids counted up, pings forged in b's
    name with b's next 2,000 rids entered a's replay window (the rate-limited ones too),
    and a refused b's real requests as replays. Rids are random now, and a message refused
    (here: over the rate limit) leaves no rid behind."""
    a, b = _pair(group, max_requests_per_s=20.0)
    adv = adversary(a)
    seen = a.server.replays._seen[("b", b.incarnation)]  # what b's pings showed mallory
    last = next(reversed(seen))
    for i in range(1, 2001):
        h = adv.header("ping", to="a", inc=b.incarnation, ep=b.endpoint, rid=last + i,
                       **{"from": "b"})  # fmt: skip
        h.update(peers=[], links=[])
        adv.send_raw(adv.frames(h))
    wait_until(lambda: a.counters.get("recv.ping") >= 2000, 10, "the forged pings read")
    assert a.counters.get("rejected.rate") > 1000  # most were over the rate: no rid kept
    assert len(a.server.replays._seen[("b", b.incarnation)]) < 200
    served = a.counters.get("served.ok") + a.counters.get("recv.ping")
    wait_until(lambda: a.counters.get("served.ok") + a.counters.get("recv.ping") > served + 5,
               10, "b still heard by a")  # fmt: skip
    assert a.counters.get("rejected.replay") == 0


def test_a_message_for_another_peer_is_refused(group, adversary):  # noqa: F811
    a = group("a", seed=1, interval_s=60.0)
    adv = adversary(a)
    n = a.params.numel(1)
    h = adv.exchange_header("zed", 1, n)
    assert adv.request(h, a.params.snapshot(1).numpy(), timeout=1.0) is None
    assert a.counters.get("rejected.misdirected") == 1 and a.counters.get("served.ok") == 0


def test_a_member_cannot_speak_as_another(group, adversary, tmp_path):  # noqa: F811
    """Keyed group: bob holds a valid key, but whatever name he writes, the server reads
    the connection's (ZAP User-Id); as carol he is refused, and carol is not blamed."""
    names = ["alice", "bob", "carol"]
    bundles = dict(zip(names, keygen(tmp_path, names), strict=True))
    a = group(None, seed=1, interval_s=60.0, group_key=str(bundles["alice"]))
    adv = adversary(a, bundle=bundles["bob"], name="bob")
    for name in ("carol", "carol", "bob"):
        h = adv.header("ping", to="alice", **{"from": name})
        h.update(peers=[], links=[])
        reply = adv.request(h, timeout=2.0)
        assert (reply is not None) == (name == "bob")
    assert a.counters.get("rejected.identity") == 2
    assert a.table.get("carol") is None and not a.table.penalised("carol")
    assert a.table.get("bob") is not None


def test_an_endless_multipart_message_is_bounded(group, adversary):  # noqa: F811
    """Frames of one message that never ends (raw ZMTP: a zmq socket would not send them)
    grew a peer by ~800 MB; the guard drops every connection past gossip.recv_guard_mb,
    the memory comes back, and honest peers reconnect and exchange."""
    import threading

    from atom.gossip.net.memguard import anon_bytes

    a = group("a", seed=1, recv_guard_mb=64)
    adv = adversary(a)
    floor = anon_bytes()
    sent = []
    attack = threading.Thread(
        target=lambda: sent.append(adv.endless_zmtp(1 << 20, 10.0, 600 << 20))
    )
    attack.start()
    peak = 0
    while attack.is_alive():
        peak = max(peak, anon_bytes() - floor)
        time.sleep(0.01)
    attack.join()
    wait_until(lambda: a.counters.get("guard.recycled") >= 1, 5, "the listener recycled")
    assert sent[0] < 300 << 20  # cut off early
    # the guard's 64 MB, plus what arrives while it checks (every 50 ms) and confirms
    # (20 ms later) at loopback speed: ~200 MB on a quiet box, 208 once beside another run
    assert peak < 256 * 2**20, f"grew {peak >> 20} MB under the attack"
    # given back (how much the C library returns to the kernel varies with what this test
    # process allocated before: the bound is what matters)
    assert anon_bytes() - floor < 100 * 2**20, (anon_bytes() - floor) >> 20
    b = group("b", seed=2, join=a.endpoint)
    wait_until(lambda: a.counters.get("served.ok") + a.counters.get("exchange.ok") > 2, 10)
    assert b.table.get("a").status == "alive"


def test_a_ping_flood_is_dropped_past_the_rate(group, adversary):  # noqa: F811
    """Every request kind is rate-limited per sender, pings too (each pong lists peers)."""
    a = group("a", seed=1, max_requests_per_s=5.0)
    adv = adversary(a)
    for _ in range(400):
        h = adv.header("ping", to="a")
        h.update(peers=[], links=[])
        adv.send_raw(adv.frames(h))
    wait_until(lambda: a.counters.get("rejected.rate") >= 400 - 64 - 10, 10, "pings dropped")
    # every ping was read (the last may still be on its way when the count is reached)
    wait_until(lambda: a.counters.get("recv.ping") >= 400, 10, "every ping received")


def test_a_connection_flood_under_a_low_file_limit_ends_cleanly(tmp_path):
    """`ulimit -n 256` (soft and hard) and 400 connections to a training peer, coming
    straight back after every recycle: the gossip server sheds them near the limit, and a
    save that still ran out of files is retried with the listener closed until it is
    done, so the run finishes with its checkpoints (it used to exit 2 at a save)."""
    import resource
    import subprocess

    from atom.gossip.net.gate import PER_ADDRESS
    from atom.store.checkpoint import list_checkpoints, step_of
    from tests import gossip_util as gu

    shards, _ = gu.make_shards(tmp_path, n_lines=400)
    run = tmp_path / "run"
    steps = 200  # long enough (seconds) for the flood to come back after recycles
    cmd = gu.peer_cmd(run, shards[0], steps, 1, "--listen", "tcp://127.0.0.1:0",
                      "--set", "train.ckpt_interval=10")  # fmt: skip

    def low_limit():
        gu._default_sigint()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=low_limit)
    try:
        host, port = gu.endpoint(run, 60, [proc]).removeprefix("tcp://").rsplit(":", 1)
        with ConnectionFlood(host, int(port), 400) as flood:
            code = gu.stop_all([proc], timeout=400)[0]  # (minutes on a loaded box)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the flood came (more than the gate lets one address hold unfinished: past that it
    # refuses the address in the kernel for a while, so the flooder opens fewer than the
    # 256 files the peer has; the gate keeps it under the limit, tests/test_gossip_flood.py)
    assert flood.opened > PER_ADDRESS, flood.opened
    text = log.read_text()
    # (torch itself may log a warning with a traceback when an import hits EMFILE)
    assert not any(line.startswith("Traceback") for line in text.splitlines()), text[-2000:]
    errors = [line for line in text.splitlines() if line.startswith("atom: error:")]
    assert (code, errors) == (0, []), text[-2000:]  # a save gets its files: the run finishes
    assert step_of(list_checkpoints(run)[-1]) == steps
    assert gu.params(run)  # the newest checkpoint loads


# strategy -> (--set arguments of the honest peers, the bound on poisoned / clean val loss)
POISONED_GROUPS = {
    "plain": ((), 1.10),
    # clean runs of the outer optimizer differ by up to ~6% here (a unit mixes every ~25
    # steps); before its robust outer step a random model cost 1.08-1.92x, 7 runs of 9
    # above 1.15 (docs/benchmarks.md "A poisoning member under the outer optimizer")
    "outer": (("--set", "gossip.strategy=diloco", "--set", "gossip.codec=int8"), 1.15),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(POISONED_GROUPS))
def test_one_poisoning_member_among_four_costs_the_honest_little(tmp_path, strategy):
    """3 honest peers on disjoint shards, with and without a 4th member that sends a
    random model of the same norm in place of its weights and claims an averaging weight
    of 1e18: no checkpoint of the honest holds a value not finite or beyond 1e6, and their
    mean val loss (on all shards) stays close to the clean run's. The bound here is 10%
    (15% for the outer optimizer): two clean runs differ by up to 3% (6%), so one pair
    cannot show 5% reliably; tools/bench/attacks.py repeats it, with the other poisons
    (sign-flipped, 1e30), for the 5% target (docs/benchmarks.md). Unguarded, this poison
    ruins them."""
    from tests.adversary import honest_group

    honest, bound = POISONED_GROUPS[strategy]
    (tmp_path / "clean").mkdir()
    (tmp_path / "poisoned").mkdir()
    clean = honest_group(tmp_path / "clean", 150, None, honest)
    poisoned = honest_group(tmp_path / "poisoned", 150, "random", honest)
    assert clean["codes"] == poisoned["codes"] == [0, 0, 0]
    assert poisoned["finite"] and poisoned["max_abs_weight"] < 1e6
    assert poisoned["mean_val_loss"] < bound * clean["mean_val_loss"], (clean, poisoned)
