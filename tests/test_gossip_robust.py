"""A broken or hostile peer cannot take over an honest one's weights (atom/gossip/robust.py).

pytest tests/test_gossip_robust.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atom.gossip.merge import DiLoCoMerge, NoLoCoMerge
from atom.gossip.net.wire import Rejected
from atom.gossip.robust import DiffGuard, safe_beta
from tests.test_gossip_peers import group, wait_until, weights  # noqa: F401 (fixture)


def test_a_peer_never_weighs_more_than_oneself():
    assert safe_beta(4.0, 4.0) == 0.5
    assert safe_beta(4.0, 1.0) == pytest.approx(0.2)
    assert safe_beta(4.0, 1e18) == 0.5  # an absurd sample count buys nothing


def test_guard_refuses_absurd_differences_from_the_start():
    guard = DiffGuard()
    mine = torch.ones(100)
    with pytest.raises(Rejected) as err:
        guard.admit(0, mine, torch.full((100,), 1e30))
    assert err.value.reason == "outlier"
    diff = torch.full((100,), 1.4)  # two independent inits differ by about this much
    assert guard.admit(0, mine, diff).size == pytest.approx(1.4) and torch.all(diff == 1.4)


def _size(diff: torch.Tensor, mine: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(mine))


def test_guard_clips_to_the_other_partners_scale():
    """Each partner is judged by the others' latest differences (lower median), never by
    its own; a unit nobody else was heard on is judged by FIRST_SCALE."""
    from atom.gossip.robust import FIRST_SCALE

    guard = DiffGuard(clip=3.0, reject=30.0)
    mine = torch.ones(100)
    flip = -2 * mine  # a sign-flipped model: right at max_relative
    guard.admit(0, mine, flip, "p")
    assert _size(flip, mine) == pytest.approx(3 * FIRST_SCALE)  # the first voice is bounded
    for k in range(3):
        guard.admit(0, mine, torch.full((100,), 0.01), f"h{k}")  # honest: 1% apart
    again = -2 * mine
    with pytest.raises(Rejected, match="others'"):  # 200x the honest scale: beyond 30x
        guard.admit(0, mine, again, "p")
    near = torch.full((100,), 0.05)  # 5x the honest scale: clipped to 3x
    guard.admit(0, mine, near, "p")
    assert _size(near, mine) == pytest.approx(0.03, rel=1e-5)
    honest = torch.full((100,), 0.012)
    guard.admit(0, mine, honest, "h0")  # p's 5% is one voice of three: h0 is not clipped
    assert _size(honest, mine) == pytest.approx(0.012, rel=1e-5)
    other = torch.full((100,), 0.5)
    guard.admit(1, mine, other, "x")  # units keep their own
    assert _size(other, mine) == pytest.approx(3 * FIRST_SCALE)
    plain = DiffGuard()  # clip 0: nothing clipped, only max_relative
    far = torch.full((100,), 1.4)
    assert plain.admit(0, mine, far, "x").size == pytest.approx(1.4)
    assert bool(torch.all(far == 1.4))


def test_an_outer_optimizer_judges_the_first_voice_by_its_own_progress():
    """With the outer schedule a poisoner can be the first partner heard on a unit every H
    steps: the first voice is clipped to clip x how far this peer moved the unit since its
    outer step (floored at FIRST_FLOOR, at most FIRST_SCALE), not to 10% of its norm."""
    from atom.gossip.merge import FIRST_FLOOR, DiLoCoMerge
    from atom.gossip.robust import FIRST_SCALE
    from tests.test_gossip_wire import FakeParams

    p = FakeParams([torch.ones(100)])
    outer = DiLoCoMerge(p, inner_steps=10, lr=1.0, momentum=0.5)
    assert outer.first_scale(0, p.snapshot(0)) == FIRST_FLOOR  # nothing trained yet
    p.t[0][:50] += 0.06  # some inner steps: moved 0.06 * sqrt(50) / |x|
    snap = p.snapshot(0)
    moved = 0.06 * 50**0.5 / float(snap.norm())
    assert outer.first_scale(0, snap) == pytest.approx(moved, rel=1e-6)
    guard = DiffGuard(clip=3.0)
    poison = torch.randn(100)
    poison *= 0.5 * float(snap.norm()) / float(poison.norm())  # half the unit's norm
    guard.admit(0, snap, poison, "p", outer.first_scale(0, snap))
    assert _size(poison, snap) == pytest.approx(3 * moved, rel=1e-5)
    outer.merge(0, snap, torch.zeros(100), beta=0.5)  # an outer step: moved ~0 since
    assert outer.first_scale(0, p.snapshot(0)) == pytest.approx(moved, rel=1e-6)  # period
    p.t[0] += 1.0  # far more than an outer step: capped where plain averaging starts
    assert outer.first_scale(0, p.snapshot(0)) == FIRST_SCALE


def test_in_a_group_of_two_the_clip_bound_is_all_there_is():
    """With no other partner to judge by, a partner within the clip bound is trusted
    again at once: two honest peers must not hold each other's distrust for good."""
    guard = DiffGuard(clip=3.0)
    mine = torch.ones(100)
    for _ in range(3):
        guard.admit(0, mine, torch.full((100,), 0.5), "b", first=0.02)  # clipped
    assert guard.trust("b") == pytest.approx(1 / 4)
    guard.admit(0, mine, torch.full((100,), 0.05), "b", first=0.02)  # 2.5x: within 3x
    assert guard.trust("b") == 1.0


def test_huge_finite_poison_with_a_huge_weight_is_refused_and_its_sender_unserved(group):  # noqa: F811
    """b answers with weights 1e30 and claims a weight of 1e18: a refuses the merge
    (outlier), its weights stay what they were, b is penalised, and b's own requests to a
    are answered with a nack until the penalty ends."""
    a = group("a", seed=1, interval_s=60.0)
    b = group("b", seed=2, interval_s=60.0, join=a.endpoint)
    honest = b.averager.serve_exchange

    def poisoned(incoming):
        header, buffers, after = honest(incoming)
        header["weight"] = 1e18
        return header, [np.full_like(np.asarray(buffers[0]), 1e30)], after

    b.averager.serve_exchange = poisoned
    wait_until(lambda: any(p.id == "b" for p in a.table.candidates()), 5, "b known to a")
    before = weights(a)
    assert not a.averager.exchange(a.table.get("b"), 1)
    assert a.counters.get("rejected.outlier") == 1
    assert torch.equal(weights(a), before)  # nothing merged (b cannot push: a shuns it)
    assert a.table.penalised("b") and all(p.id != "b" for p in a.table.candidates())
    wait_until(lambda: b.table.get("a") is not None, 5, "a known to b")

    def refused() -> bool:  # a refuses to serve b
        # b's own lane may hold unit 1 in an exchange of its own (the call then sends
        # nothing), and on a loaded box b's wait may end before a's worker reached it
        assert not b.averager.exchange(b.table.get("a"), 1)
        return a.counters.get("served.refused") >= 1

    wait_until(refused, 10, "a refusing to serve b")
    assert torch.equal(weights(a), before)


def test_a_joiner_refuses_a_group_past_its_own_end(group, text_dataset, tmp_path):  # noqa: F811
    """A member claiming step 10^12: the joiner would copy it and train 0 steps, exit 0;
    it stops in one line instead."""
    from atom.config import ConfigError
    from atom.run.train import Trainer
    from tests.conftest import tiny_config
    from tests.test_gossip_peers import FAST

    a = group("a", seed=1, interval_s=60.0)
    a.after_step(10**12)
    gossip = {
        "listen": "tcp://127.0.0.1:0",
        "join": a.endpoint,
        "name": "b",
        **FAST,
        "strategy": "gossip",
        "codec": "fp32",
    }  # a's: the group fixture's
    cfg = tiny_config(train={"data": str(text_dataset), "max_steps": 5}, gossip=gossip)
    with pytest.raises(ConfigError, match=r"the group is at step 1000000000000, at or "
                                          r"past this run's train.max_steps \(5\)"):  # fmt: skip
        Trainer(cfg, tmp_path / "run", progress=False)


def _hello(pid: str, peers=()):
    return {"from": pid, "inc": 1, "ep": "tcp://127.0.0.1:9", "kind": "ping", "ready": True,
            "step": 1, "samples": 4, "peers": list(peers)}  # fmt: skip


def test_the_peer_table_is_bounded_and_keeps_its_live_peers():
    """15,000 fake ids made every heartbeat list them all: the table keeps at most
    max_peers; introductions (hearsay) never displace a live peer; a flood of ids heard
    directly displaces only peers that never completed an exchange."""
    from atom.gossip.membership import PeerTable

    t = PeerTable("me", dead_after=60, penalty_s=10, max_peers=8)
    for k in range(6):
        t.heard(_hello(f"real{k}"))
        t.exchanged(f"real{k}", 1000, 0.01, 0.0, 1e-3)  # partners that proved themselves
    fakes = [{"id": f"fake{k}", "ep": "tcp://127.0.0.1:9", "inc": 1, "step": 1, "ready": True}
             for k in range(15_000)]  # fmt: skip
    t.heard(_hello("real0", fakes))  # one message introducing 15,000 others
    assert len(t.peers) == 8 and all(f"real{k}" in t.peers for k in range(6))
    for k in range(100):  # ids heard directly
        t.heard(_hello(f"loud{k}"))
    assert len(t.peers) <= 8 and all(f"real{k}" in t.peers for k in range(6))
    assert "loud99" in t.peers  # the newest newcomer still gets a seat
    for k in range(50_000):  # penalties are bounded too (the soonest to expire go first)
        t.penalise(f"fake{k}")
    assert len(t.penalties) == 4 * 8 and t.penalised("fake49999")


def test_rate_limits_bound_each_sender_and_each_address():
    from atom.gossip.net.limits import RateLimiter, RequestLimits

    bucket = RateLimiter(rate=10, burst=20)
    assert sum(bucket.allow("x", now=0.0) for _ in range(100)) == 20  # the burst, then none
    assert sum(bucket.allow("x", now=1.0) for _ in range(100)) == 10  # a second refills 10
    assert bucket.allow("y", now=1.0)  # other senders have their own bucket
    limits = RequestLimits(rate=10)  # per sender burst 64; per address 10x
    one_id = sum(limits.allow("1.2.3.4", "mallory", now=0.0) for _ in range(1000))
    assert one_id == 64
    rotating = sum(limits.allow("1.2.3.4", f"id{k}", now=0.0) for k in range(5000))
    assert rotating == 640 - 64  # new ids do not escape the address's bound
    assert RateLimiter(rate=0, burst=1).allow("z")  # 0: no limit
    small = RateLimiter(rate=1, burst=1, max_keys=100)
    for k in range(10_000):
        small.allow(k)
    assert len(small._buckets) == 100


def test_a_pull_flood_is_dropped_past_the_rate(group):  # noqa: F811
    """sreq (each snapshots a unit) as fast as a client can send: past the per-sender
    limit they are dropped unanswered and counted; an honest peer still exchanges."""
    import msgpack
    import zmq

    from tests.test_gossip_peers import good_header, raw_client

    a = group("a", seed=1, interval_s=60.0, max_requests_per_s=5.0)
    ctx = zmq.Context()
    sock = raw_client(ctx, a.endpoint)
    try:
        for rid in range(300):
            header = good_header(a, kind="sreq", rid=rid)
            for key in ("codec", "weight", "delta", "tensors"):
                header.pop(key)
            sock.send_multipart([msgpack.packb(header)])
        wait_until(lambda: a.counters.get("rejected.rate") >= 300 - 64 - 5, 10, "drops")
        answered = 0
        while sock.poll(300):
            sock.recv_multipart()
            answered += 1
        assert answered <= 64 + 20
    finally:
        sock.close()
        ctx.term()


def test_a_partner_clipped_again_and_again_fades_out():
    guard = DiffGuard(clip=3.0)
    mine = torch.ones(100)
    for k in range(3):
        guard.admit(0, mine, torch.full((100,), 0.01), f"h{k}")
    for n in range(1, 5):  # poison: clipped every time
        judged = guard.admit(0, mine, torch.full((100,), 1.0), "p")
        assert guard.trust("p") == pytest.approx(1 / (1 + n)) == judged.trust  # as judged
    assert guard.trust("h0") == 1.0
    within = torch.full((100,), 0.025)  # within the clip bound (3x), not close (1.5x)
    guard.admit(0, mine, within, "p")
    assert torch.all(within == 0.025) and guard.trust("p") == pytest.approx(1 / 5)
    guard.admit(0, mine, torch.full((100,), 0.01), "p")  # came close: trusted again
    assert guard.trust("p") == 1.0


def test_an_outer_step_is_not_built_on_a_distrusted_partner():
    """An exchange with a partner the robust merge shrank lately is averaged in plainly:
    weights and outer weights move alike, the momentum does not take it (it would carry
    it on over the next outer steps), and the unit comes due again in H / 4 steps (soon,
    for another partner, but not at the gossip's full rate)."""
    from tests.test_gossip_wire import FakeParams

    p = FakeParams([torch.zeros(4)])
    outer = DiLoCoMerge(p, inner_steps=4, lr=1.0, momentum=0.5)
    outer.step = 4
    p.t[0] += 0.5  # inner progress
    snap = p.snapshot(0)
    outer.merge(0, snap, torch.full((4,), 1.0), beta=0.25, clipped=True)
    assert torch.allclose(p.t[0], torch.full((4,), 0.75))
    assert torch.allclose(outer.outer[0], torch.full((4,), 0.25))  # progress kept apart
    assert float(outer.momentum[0].abs().max()) == 0.0 and not outer.due(0)
    outer.step = 5  # H / 4 later
    assert outer.due(0)
    outer.merge(0, p.snapshot(0), torch.zeros(4), beta=0.5)  # a trusted partner: outer step
    assert float(outer.momentum[0].abs().max()) > 0 and not outer.due(0)
    # noloco's payload [outer weights; pseudo-gradient d = outer - x]: weights and outer
    # weights move alike, so our own d, which a later outer step feeds the momentum, is
    # untouched by the distrusted partner's
    q = FakeParams([torch.zeros(4)])
    split = NoLoCoMerge(q, inner_steps=2, lr=1.0, momentum=0.5, consensus=1.0)
    split.step = 2
    q.t[0] += 0.5  # our d: -0.5
    snap = q.snapshot(0)
    theirs = torch.cat([torch.full((4,), 2.0), torch.full((4,), 9.0)])  # d 9: absurd
    split.merge(0, snap, split.weights_of(theirs, 4) - snap, 0.25, theirs, clipped=True)
    assert torch.allclose(q.t[0], torch.full((4,), 0.5 + 0.25 * (-7.0 - 0.5)))
    assert torch.allclose(split.outer[0] - q.t[0], torch.full((4,), -0.5))  # d as it was
    assert float(split.momentum[0].abs().max()) == 0.0
    split.step = 4
    snap = q.snapshot(0)
    honest = torch.cat([snap, torch.zeros(4)])  # where we are, and no progress of its own
    split.merge(0, snap, split.weights_of(honest, 4) - snap, 0.5, honest)
    # the momentum holds the pair's mean pseudo-gradient: (-0.5 + 0) / 2, nothing of 9
    assert torch.allclose(split.momentum[0], torch.full((4,), -0.25))


def test_a_rollback_distrusts_the_peers_merged_since_the_checkpoint(group):  # noqa: F811
    import time

    a = group("a", seed=1)
    saved_at = time.monotonic()
    group("b", seed=2, join=a.endpoint)
    wait_until(lambda: a.counters.get("exchange.ok") + a.counters.get("served.ok") > 0)
    assert a.distrust_since(saved_at) == ["b"] and a.table.penalised("b")
    assert all(p.id != "b" for p in a.table.candidates())
    assert a.distrust_since(time.monotonic() + 1) == []


def test_the_replay_window_assumes_no_order_and_forgets_with_time():
    from atom.gossip.net.replay import ReplayWindow

    w = ReplayWindow(horizon_s=10.0, per_sender=4, max_senders=2)
    assert w.fresh("b", 1, 2**62, now=0.0)  # a forged huge rid blocks nothing after it
    assert w.fresh("b", 1, 5, now=0.0) and not w.fresh("b", 1, 5, now=1.0)
    assert w.fresh("b", 2, 5, now=1.0)  # another incarnation: its own ids
    assert w.fresh("b", 1, 3, now=1.0)  # an early-drawn id arriving late
    assert w.fresh("b", 1, 5, now=12.0)  # past the horizon: forgotten
    for rid in range(10):
        w.fresh("c", 1, rid, now=13.0)
    assert len(w._seen) == 2 and all(len(v) <= 4 for v in w._seen.values())
