"""Peers, the parts without sockets: wire validation, codecs, merge math, selection,
shaping, keys, config.

    pytest tests/test_gossip_wire.py
"""

from __future__ import annotations

import math
import random
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

from atom.config import ConfigError, load_config
from atom.config.gossip import is_loopback, parse_rates
from atom.gossip.membership import FIRST_CONTACT_S, PeerState, PeerTable
from atom.gossip.merge import DiLoCoMerge, GossipMerge, NoLoCoMerge
from atom.gossip.net.codecs import BLOCK, CODECS, decode_checked, get_codec, roundtrip
from atom.gossip.net.keys import keygen, load_bundle
from atom.gossip.net.shaping import LinkShaper, TokenBucket
from atom.gossip.net.wire import (
    PROTOCOL,
    Expect,
    Rejected,
    check_frames,
    fingerprint,
    pack,
    parse_header,
)
from atom.gossip.pairref import PairRefs
from atom.gossip.selection import FlowSelector, RandomSelector

EXPECT = Expect("open:test", "f" * 24, 5)


def header(**over):
    h = {
        "v": PROTOCOL, "kind": "xreq", "group": "open:test", "fp": "f" * 24, "from": "alice",
        "to": "bob", "inc": 7, "ep": "tcp://127.0.0.1:5555", "rid": 1, "step": 3, "samples": 12,
        "ready": True, "unit": 1, "codec": "fp32", "weight": 12.0,
        "tensors": [{"dtype": "f32", "n": 4}], "delta": False,
    }  # fmt: skip
    h.update(over)
    return h


def _pong(**over):
    base = {k: v for k, v in header().items() if k not in ("unit", "codec", "weight", "tensors",
                                                           "delta")}  # fmt: skip
    return dict(base, kind="pong", peers=[], links=[], **over)


def test_valid_header_roundtrips():
    assert parse_header(pack(_pong(reach=False)), EXPECT)["reach"] is False
    h = parse_header(pack(header()), EXPECT)
    assert h["from"] == "alice" and h["unit"] == 1 and h["tensors"] == [{"dtype": "f32", "n": 4}]
    check_frames(h, [bytes(16)])


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"\xc1\xff garbage", "garbage"),
        (msgpack.packb([1, 2, 3]), "garbage"),
        (pack(header(v=PROTOCOL + 1)), "version"),
        (pack(header(kind="exec")), "schema"),
        (pack(header(extra=1)), "schema"),
        (pack({k: v for k, v in header().items() if k != "weight"}), "schema"),
        (pack(header(step=True)), "schema"),
        (pack(header(step=-1)), "schema"),
        (pack(header(weight=float("nan"))), "schema"),
        (pack(header(weight=float("inf"))), "schema"),
        (pack(header(**{"from": "../etc/passwd"})), "schema"),
        (pack(header(ep="http://evil")), "schema"),
        (pack(header(codec="pickle")), "codec"),
        (pack(header(tensors=[{"dtype": "object", "n": 4}])), "schema"),
        (pack(header(group="open:other")), "group"),
        (pack(header(fp="0" * 24)), "fingerprint"),
        (pack(header(unit=5)), "schema"),
        (pack(header(reach=True)), "schema"),  # only a pong says whether its pinger is reachable
        (pack(_pong(reach="yes")), "schema"),
        (msgpack.packb(header(pad="x" * 70_000)), "oversized"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "garbage"),
    ],
)
def test_bad_headers_are_rejected(data, reason):
    with pytest.raises(Rejected) as err:
        parse_header(data, EXPECT)
    assert err.value.reason == reason


def test_frames_must_match_the_header():
    h = parse_header(pack(header()), EXPECT)
    for frames in ([], [bytes(15)], [bytes(16), bytes(4)]):
        with pytest.raises(Rejected) as err:
            check_frames(h, frames)
        assert err.value.reason == "truncated"


def test_fingerprint_sees_names_and_shapes():
    a = fingerprint([(0, [("w", (4, 4))]), (1, [("b", (4,))])])
    assert a == fingerprint([(0, [("w", (4, 4))]), (1, [("b", (4,))])])
    assert a != fingerprint([(0, [("w", (4, 5))]), (1, [("b", (4,))])])
    assert a != fingerprint([(0, [("v", (4, 4))]), (1, [("b", (4,))])])


@pytest.mark.parametrize("name,tol", [("fp32", 0.0), ("bf16", 2**-8), ("int8", 1 / 127)])
def test_codecs_roundtrip_within_their_precision(name, tol):
    x = torch.randn(1000) * 0.02
    x[:BLOCK] *= 50  # one block of large values must not cost the others their precision
    codec = get_codec(name)
    y = roundtrip(codec, x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if name == "int8":
        for b in range(0, 1000, BLOCK):
            blk = x[b : b + BLOCK]
            assert (y[b : b + BLOCK] - blk).abs().max() <= blk.abs().max() * tol / 2 + 1e-9
    else:
        assert ((y - x).abs() <= x.abs() * tol).all()
    assert codec.wire_bytes(1000) == sum(b.nbytes for b in codec.encode(x)[1])


@pytest.mark.parametrize("name", sorted(CODECS))
def test_codecs_reject_nonfinite_and_wrong_sizes(name):
    codec = get_codec(name)
    x = torch.randn(100)
    x[7] = float("nan")
    metas, bufs = codec.encode(x)
    with pytest.raises(Rejected) as err:
        decode_checked(codec, metas, bufs, 100)
    assert err.value.reason == "nonfinite"
    with pytest.raises(Rejected):
        decode_checked(codec, metas, bufs, 99)


def test_topk_sends_the_largest_moves_and_reads_them_back():
    codec = get_codec("topk", 0.05)
    d = torch.randn(1000) * 0.01
    big = torch.randperm(1000)[:50]
    d[big] += torch.sign(d[big]) * 1.0  # the 50 largest, by far
    metas, bufs, sent = codec.encode_sparse(d)
    assert metas[0] == {"dtype": "i32", "n": 50}
    assert sum(b.nbytes for b in bufs) == codec.wire_bytes(1000) < 0.3 * 1000
    got = codec.decode_sparse(metas, bufs, 1000)
    assert torch.equal(got, sent)  # the sender knows exactly what the receiver reads
    assert torch.equal(got != 0, torch.zeros(1000, dtype=torch.bool).index_fill_(0, big, True))
    assert (got[big] - d[big]).abs().max() <= d[big].abs().max() / 127
    # every header the parser accepts (i32 indices, an int ref tag)
    h = header(codec="topk", ref=2**40, tensors=metas)
    parsed = parse_header(pack(h), EXPECT)
    assert parsed["ref"] == 2**40
    check_frames(parsed, [b.tobytes() for b in bufs])  # as frames arrive: bytes


def test_topk_of_a_large_unit_keeps_about_k_and_only_the_largest():
    codec = get_codec("topk", 0.05)
    n = 300_001
    d = torch.randn(n) * torch.rand(n)  # magnitudes of every size
    d[: n // 20] *= 10  # a stretch at another scale (a sample must not cluster elsewhere)
    d[-4096:].view(-1, 64)[:, 5] = 50.0  # one column of rows: a stride must not miss it
    metas, bufs, sent = codec.encode_sparse(d)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[torch.from_numpy(bufs[0].astype(np.int64))] = True
    assert 0.9 * 0.05 * n <= int(kept.sum()) <= 1.1 * 0.05 * n
    assert float(d.abs()[kept].min()) >= float(d.abs()[~kept].max())  # a threshold
    assert torch.equal(codec.decode_sparse(metas, [b.tobytes() for b in bufs], n), sent)


def test_topk_refuses_indices_it_cannot_trust():
    codec = get_codec("topk", 0.01)
    metas, bufs, _ = codec.encode_sparse(torch.randn(1000))

    def with_indices(idx):
        return [np.asarray(idx, dtype="<i4"), *bufs[1:]]

    for bad in ([5, 5, 7, 9, 11, 13, 15, 17, 19, 21],  # a repeat would add twice
                [9, 7, 5, 11, 13, 15, 17, 19, 21, 23],  # not increasing
                [-1, 7, 9, 11, 13, 15, 17, 19, 21, 23],  # out of range
                [1, 7, 9, 11, 13, 15, 17, 19, 21, 1000]):  # fmt: skip
        with pytest.raises(Rejected, match="indices"):
            codec.decode_sparse(metas, with_indices(bad), 1000)
    with pytest.raises(Rejected, match="topk expects"):
        codec.decode_sparse(metas, bufs, 5)  # more entries than the unit has
    with pytest.raises(Rejected, match="topk expects"):
        codec.decode_sparse(metas[1:], bufs[1:], 1000)
    scales = np.full(1, np.inf, dtype="<f4")
    with pytest.raises(Rejected, match="scales"):
        codec.decode_sparse(metas, [bufs[0], bufs[1], scales], 1000)
    with pytest.raises(Rejected, match="ref"):
        parse_header(pack(header(codec="topk", ref=-3)), EXPECT)


def test_pair_references_keep_at_most_the_recent_partners():
    refs = PairRefs(2)
    for p in ("a", "b"):
        refs.set(p, 0, 1, torch.zeros(3))
    refs.set("a", 1, 2, torch.ones(3))
    assert refs.get("a", 1)[0] == 2
    refs.set("c", 0, 3, torch.zeros(3))  # b is the least recently used: dropped whole
    assert refs.get("b", 0) is None and refs.get("a", 0) is not None
    assert refs.nbytes() == 3 * 3 * 4
    refs.drop("a", 0)
    refs.drop("a", 1)
    assert refs.get("a", 1) is None and refs.nbytes() == 3 * 4


class FakeParams:
    """UnitParams over plain tensors."""

    def __init__(self, tensors):
        self.t = tensors
        self.units = list(range(len(tensors)))

    def snapshot(self, u):
        return self.t[u].clone()

    def add(self, u, delta):
        self.t[u] += delta


def test_gossip_merge_keeps_local_progress():
    p = FakeParams([torch.zeros(4)])
    snap = p.snapshot(0)
    p.t[0] += 1.0  # an optimizer step lands while the exchange is on the wire
    GossipMerge(p).merge(0, snap, torch.full((4,), 2.0) - snap, beta=0.5)
    assert torch.allclose(p.t[0], torch.full((4,), 2.0))  # mean(0, 2) + the step


def test_diloco_with_unit_lr_and_no_momentum_is_gossip():
    a, b = FakeParams([torch.zeros(4)]), FakeParams([torch.zeros(4)])
    d = DiLoCoMerge(a, inner_steps=2, lr=1.0, momentum=0.0)
    g = GossipMerge(b)
    d.step = 1
    assert not d.due(0)
    d.step = 2
    assert d.due(0)
    for m in (d, g):
        m.params.t[0] += 0.5  # inner steps
    remote = torch.full((4,), 3.0)
    d.merge(0, a.snapshot(0), remote - a.snapshot(0), 0.25)
    g.merge(0, b.snapshot(0), remote - b.snapshot(0), 0.25)
    assert torch.allclose(a.t[0], b.t[0]) and not d.due(0)


def test_diloco_outer_step_is_nesterov():
    p = FakeParams([torch.zeros(1)])
    d = DiLoCoMerge(p, inner_steps=1, lr=0.7, momentum=0.9)
    p.t[0] -= 1.0  # inner progress; the partner agrees exactly: g = outer - target = 1
    d.merge(0, p.snapshot(0), torch.zeros(1), 0.5)
    # m = 1; outer = 0 - 0.7 * (1 + 0.9 * 1)
    assert math.isclose(float(p.t[0]), -0.7 * 1.9, rel_tol=1e-6)


def _noloco_exchange(a: NoLoCoMerge, b: NoLoCoMerge, beta: float = 0.5) -> None:
    """Both ends of one exchange of unit 0, payloads as the averager builds them."""
    sa, sb = a.params.snapshot(0), b.params.snapshot(0)
    pa, pb = a.payload(0, sa), b.payload(0, sb)
    n = sa.numel()
    a.merge(0, sa, a.weights_of(pb, n) - sa, beta, pb)
    b.merge(0, sb, b.weights_of(pa, n) - sb, beta, pa)


def test_noloco_with_unit_lr_no_momentum_and_full_consensus_is_gossip():
    a, b = FakeParams([torch.zeros(4)]), FakeParams([torch.full((4,), 2.0)])
    na, nb = (NoLoCoMerge(p, 1, lr=1.0, momentum=0.0, consensus=1.0) for p in (a, b))
    a.t[0] += torch.tensor([0.5, -1.0, 0.0, 3.0])  # inner progress of each end
    b.t[0] -= 0.25
    mean = (a.t[0] + b.t[0]) / 2
    _noloco_exchange(na, nb)
    assert torch.allclose(a.t[0], mean) and torch.allclose(b.t[0], mean)
    assert torch.allclose(na.outer[0], mean) and torch.allclose(nb.outer[0], mean)


def test_noloco_momentum_sees_the_pseudo_gradient_not_the_disagreement():
    a, b = FakeParams([torch.zeros(3)]), FakeParams([torch.ones(3)])
    na, nb = (NoLoCoMerge(p, 1, lr=0.7, momentum=0.9, consensus=1.0) for p in (a, b))
    _noloco_exchange(na, nb)  # outer weights apart, nobody trained: d = 0
    assert float(na.momentum[0].abs().max()) == 0.0
    assert torch.allclose(a.t[0], torch.full((3,), 0.5)) and torch.allclose(a.t[0], b.t[0])
    # the same disagreement through DiLoCo's rule lands in the momentum, and overshoots
    c = FakeParams([torch.zeros(3)])
    dc = DiLoCoMerge(c, 1, lr=0.7, momentum=0.9)
    dc.merge(0, c.snapshot(0), torch.ones(3), 0.5)
    assert float(dc.momentum[0].abs().min()) > 0 and float(c.t[0][0]) > 0.5
    # a shared pseudo-gradient gets the Nesterov step: both ends trained the same -1
    a.t[0] -= 1.0
    b.t[0] -= 1.0
    _noloco_exchange(na, nb)
    assert torch.allclose(a.t[0], torch.full((3,), 0.5 - 0.7 * 1.9))
    assert torch.allclose(na.momentum[0], torch.ones(3))


def peer(pid, bw=None, last=None, rtt=1e-3):
    p = PeerState(pid, f"tcp://127.0.0.1:{1000 + len(pid)}", 1, ready=True, rtt=rtt, bw=bw)
    p.first_seen = time.monotonic() - 100
    p.last_exchange = last
    return p


def test_flow_selection_prefers_fast_links_but_starves_no_one():
    now = time.monotonic()
    fast = peer("fast", bw=125e6, last=now - 0.05)
    slow1 = peer("slow1", bw=2.5e6, last=now - 0.05)
    slow2 = peer("slow2", bw=2.5e6, last=now - 0.05)
    sel = FlowSelector("me", explore=0.1, rng=random.Random(0))
    counts = {"fast": 0, "slow1": 0, "slow2": 0}
    for _ in range(300):
        counts[sel.choose([fast, slow1, slow2], 1_000_000).id] += 1
    assert counts["fast"] > 200 and counts["slow1"] > 0 and counts["slow2"] > 0
    slow1.last_exchange = now - 60  # a link left alone long enough becomes worth its cost
    picks = [sel.choose([fast, slow1, slow2], 1_000_000).id for _ in range(200)]
    assert picks.count("slow1") > 100


def test_flow_cost_uses_both_directions_and_load():
    sel = FlowSelector("me")
    p = peer("p", bw=10e6)
    base = sel.cost(p, 1_000_000, 10e6)
    p.their_links["me"] = (1e6, 1e-3)  # the other direction is slow
    assert sel.cost(p, 1_000_000, 10e6) > base
    q = peer("q", bw=10e6)
    q.served, q.load = 0.05, 15.0  # busy serving others
    assert sel.cost(q, 1_000_000, 10e6) > base


def test_flow_selection_turns_away_from_a_partner_it_keeps_clipping():
    """A poisoner shows the largest disagreement by construction, which alone would make
    it the favourite partner; one clipped exchange after another, the robust merge's trust
    in it falls (robust.DiffGuard.trust) and so does its share of our exchanges."""
    from atom.gossip.robust import DiffGuard

    guard = DiffGuard(clip=3.0)
    now = time.monotonic()
    ps = [peer(pid, bw=125e6, last=now - 1.0) for pid in ("bad", "h1", "h2")]
    ps[0].drift, ps[1].drift, ps[2].drift = 0.4, 0.1, 0.1  # 4x: the most drift can tilt
    sel = FlowSelector("me", explore=0.0, rng=random.Random(0), trust=guard.trust)
    share = lambda: [sel.choose(ps, 1000).id for _ in range(600)].count("bad") / 600  # noqa: E731
    assert share() > 0.55  # trusted, it is chosen 4 times as often as each honest peer
    mine = torch.ones(100)
    for k in range(2):
        guard.admit(0, mine, torch.full((100,), 0.01), f"h{k + 1}")
    for _ in range(12):  # clipped every time
        guard.admit(0, mine, torch.full((100,), 0.5), "bad")
    assert guard.trust("bad") == pytest.approx(1 / 13)
    assert share() < 0.2  # 0.4 / 13 against 0.1 + 0.1


def test_random_selection_is_uniform():
    sel = RandomSelector(random.Random(1))
    ps = [peer(f"p{i}") for i in range(4)]
    counts = {p.id: 0 for p in ps}
    for _ in range(4000):
        counts[sel.choose(ps, 1).id] += 1
    assert all(900 < c < 1100 for c in counts.values())
    assert sel.choose([], 1) is None


def test_silence_allowed_follows_the_link():
    """dead_after is the floor (a LAN notices a crash as fast as before); a slow or far
    link allows what may be queued ahead of a ping at its measured speed and 4 round
    trips, capped."""
    t = PeerTable("me", dead_after=1.5, penalty_s=10, queued_bytes=2_800_000)
    lan = PeerState("lan", "tcp://10.0.0.2:1", 1, rtt=0.0005, bw=100e6)
    lan.reached = time.monotonic()  # our pings reach it (they measured its round trip)
    assert t.silence(lan) == 1.5
    unmeasured = PeerState("new", "tcp://10.0.0.3:1", 1)
    assert t.silence(unmeasured) == FIRST_CONTACT_S  # our ping has not reached it yet
    unmeasured.reached = time.monotonic()
    assert t.silence(unmeasured) == 1.5
    far = PeerState("far", "tcp://10.0.0.4:1", 1, rtt=0.2, bw=5e6 / 8)  # 200 ms, 5 Mb/s
    far.reached = time.monotonic()
    assert t.silence(far) == pytest.approx(4 * 0.2 + 2 * 1_400_000 / (5e6 / 8))  # 5.28 s
    crawling = PeerState("crawl", "tcp://10.0.0.5:1", 1, rtt=1.0, bw=1000.0)
    assert t.silence(crawling) == 120.0
    # the sweep judges each peer by its own link
    now = time.monotonic()
    for p in (lan, far):
        p.status, p.last_heard = "alive", now - 3.0
        t.peers[p.id] = p
    assert t.sweep() == ["lan"] and t.get("far").status == "alive"


def test_peer_table_liveness_goodbye_and_restart():
    t = PeerTable("me", dead_after=0.2, penalty_s=10)
    h = {"from": "a", "inc": 1, "ep": "tcp://127.0.0.1:1", "kind": "ping", "ready": True,
         "step": 5, "samples": 20, "peers": [{"id": "b", "ep": "tcp://127.0.0.1:2", "inc": 3,
                                              "step": 1, "ready": True}]}  # fmt: skip
    t.heard(h)
    assert t.candidates() == []  # a is heard, but we have not reached its endpoint yet
    t.pinged("a", True, 1.0)  # our ping to it was answered from there
    assert [p.id for p in t.candidates()] == ["a"]  # b is only hearsay until it answers
    assert t.get("b").status == "dead"
    t.penalise("a")
    assert t.candidates() == []
    t.penalties.clear()
    time.sleep(0.25)
    assert t.sweep() == ["a"] and t.candidates() == []
    t.heard(h)
    t.left("a", 1)
    assert t.get("a").status == "left"
    t.heard(h)  # a stale message from the incarnation that left
    assert t.get("a").status == "left"
    t.heard(dict(h, inc=2))  # restarted, says a message: unproven, only a claim to check
    assert t.get("a").status == "left" and t.unproven() == [("a", h["ep"])]
    t.heard(dict(h, inc=2), proven=True)  # its endpoint answered our ping as a, inc 2
    assert t.get("a").status == "alive" and t.get("a").incarnation == 2
    assert t.unproven() == []


def test_token_bucket_paces_to_the_rate():
    bucket = TokenBucket(1e6, burst=0)
    assert math.isclose(bucket.reserve(100_000), 0.1, rel_tol=0.05)
    assert math.isclose(bucket.reserve(100_000), 0.2, rel_tol=0.05)  # queued behind the first
    shaper = LinkShaper(0.0, {"slow": 8.0})  # 1 MB/s
    assert shaper.delay(("fast", "tcp://127.0.0.1:1"), 10**7) == 0.0
    stop = threading.Event()
    t0 = time.monotonic()
    assert shaper.wait(("slow",), 64 * 1024 + 100_000, stop)
    assert 0.08 < time.monotonic() - t0 < 0.5
    shared = LinkShaper(1000.0, {"x+y": 8.0})  # x and y behind one 1 MB/s uplink
    assert shared.delay(("x",), 64 * 1024 + 100_000) > 0.05
    assert shared.delay(("y",), 100_000) > 0.15  # queued behind x's bytes
    assert shared.delay(("z",), 100_000) < 0.01  # elsewhere: the 1 Gb/s default
    assert shared.rate_mbps("y") == 8.0 and shared.rate_mbps("z") == 1000.0


def test_config_refuses_open_non_loopback_listen():
    with pytest.raises(ConfigError, match="needs a group key"):
        load_config(None, ["gossip.listen=tcp://0.0.0.0:5555"])
    cfg = load_config(None, ["gossip.listen=tcp://0.0.0.0:5555", "gossip.insecure=true"])
    assert cfg.gossip.enabled
    for bad in ["gossip.listen=http://x:1", "gossip.codec=zip", "gossip.strategy=allreduce"]:
        with pytest.raises(ConfigError):
            load_config(None, [bad])
    client = load_config(None, ["gossip.join=tcp://127.0.0.1:1"]).gossip  # no listen
    assert client.enabled and client.client and not cfg.gossip.client
    assert is_loopback("tcp://127.0.0.1:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://192.168.1.2:5555")
    assert parse_rates("a=20, tcp://127.0.0.1:5=1000") == {"a": 20.0, "tcp://127.0.0.1:5": 1000.0}
    with pytest.raises(ValueError):
        parse_rates("a=0")


def test_keygen_bundles_and_adding_a_peer(tmp_path):
    bundles = keygen(tmp_path / "g", ["alice", "bob"])
    alice = load_bundle(bundles[0])
    bob = load_bundle(bundles[1])
    assert alice.name == "alice" and bob.name == "bob"
    assert alice.group_public == bob.group_public and alice.public != bob.public
    assert sorted(p.name for p in alice.allowed_dir.glob("*.key")) == ["alice.key", "bob.key"]
    keygen(tmp_path / "g", ["carol"])  # existing bundles learn carol's public key
    assert (bundles[0] / "allowed" / "carol.key").exists()
    with pytest.raises(ConfigError, match="already exists"):
        keygen(tmp_path / "g", ["bob"])
    with pytest.raises(ConfigError, match="not a peer bundle"):
        load_bundle(tmp_path / "g")


def test_forged_pings_keep_no_ghost_where_a_restarted_peer_cannot_move_in():
    """b crashed; someone keeps pinging in its old name and address (both public). The
    restarted b, at a new address, is adopted once it answers there: the old address
    stopped answering our own pings, whatever was said in its name."""
    t = PeerTable("me", dead_after=0.2, penalty_s=10)
    old = {"from": "b", "inc": 1, "ep": "tcp://127.0.0.1:1", "kind": "ping", "ready": True,
           "step": 5, "samples": 20}  # fmt: skip
    t.heard(old, proven=True)  # it answered our ping there once
    new = dict(old, inc=2, ep="tcp://127.0.0.1:2")
    t.heard(new, proven=True)  # the old address still answers: not moved
    assert t.get("b").endpoint == old["ep"]
    time.sleep(0.25)
    t.heard(old)  # a forged ping in the ghost's name: refreshes nothing that matters
    t.heard(new, proven=True)  # the restarted b answered at its new address
    assert (t.get("b").endpoint, t.get("b").incarnation) == (new["ep"], 2)
