"""Membership: who is in the group, alive, ready, and how good the link to each one is
(the heartbeat thread that keeps it is heartbeat.py).

Liveness is first-hand only: a peer is alive while *it* has talked to us (a pong, a
request, a reply) within dead_after_s. Peer lists heard from others only introduce new
names, as hints: an entry that is not alive, never listed nor chosen, until our own ping
reaches that name at that address (in a keyed group, that name's own key answers
there). An introducer leaves at most MAX_HINTS_PER_SOURCE such hints unanswered at a
time, and a hint (or any entry whose endpoint never answered) is forgotten HINT_TTL_S
after it was last heard of. We list only peers whose endpoint answered our own ping.
That is what keeps one group on a LAN: every member pings every member it knows of, and
everyone a member reached is listed in its pings, so knowledge spreads to all within a
few heartbeats and two halves that learn of each other merge. A dead peer that answered
once stays in the table and is pinged again every few heartbeats (it may come back); one
that said goodbye is tombstoned for that incarnation so stale lists cannot resurrect it,
while a restart (new incarnation) is welcome at once.

Who may change what (open groups have no keys, so a header's `from` proves nothing): a
message may refresh the entry it matches (id, endpoint, incarnation), but a peer's
endpoint or incarnation changes only on proof, a reply to our own request from that
endpoint naming that id, and a live peer does not move to another endpoint until its old
one stops answering (a forged ping once moved a peer to a dead address). A claim that is
not proven yet is remembered and pinged. An unproven goodbye marks the peer "leaving" (no
longer a partner) until a ping settles it: a leaving peer answers `nack leaving` (or not
at all), an impostor's victim answers `pong` and stays. A peer that has proven itself
alive (answered our own ping lately) loses nothing to an unproven goodbye: it stays a
partner while the next ping decides (forged goodbyes sent every second once kept a live
peer "leaving" most of the time: 1-2 exchanges with it in 10 s instead of 11-39). In
keyed groups the server has already tied `from` to the connection's key (transport.py),
so a goodbye is the member's own; its address is proven as in an open group, by our own
ping, which only that member's key can answer (client.py): a member that listed another
name at an address of its own made its victims list and exchange with it under that name,
and kept the real one out when it came.

Link measurements (EWMA): round-trip time from pings, bandwidth from a probe at first
contact and then from every real exchange. They are shared in heartbeats, so each side
sees both directions of a link (GWTF's cost uses bw_ij + bw_ji).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from atom.gossip.net.wire import MAX_LISTED

EWMA = 0.3  # weight of a new link measurement
FORGET_AFTER_S = 600.0  # drop dead peers from the table (seeds are still retried)
EARLY_ROUND_S = 0.1  # ping rounds asked for early (check_soon) come no closer than this
# silence allowed on a slow or far link: a ping may wait behind every message queued on it
# (each lane's request and reply: queued_bytes), plus a few round trips (a lost packet costs
# TCP about one); at most this
SILENT_RTTS = 4
MAX_DEAD_AFTER_S = 120.0
FIRST_CONTACT_S = 5.0  # silence allowed before our ping reached it (a probe's timeout)
# reachability: a peer we hear from whose endpoint missed this many of our pings in a row
# is unreachable (behind a NAT, a firewall): a client, never chosen, not listed; its
# endpoint is pinged again after 2, 4, 8 ... heartbeats, at least once a minute
UNREACHED_AFTER = 3
REPROBE_MAX_S = 60.0
# second-hand names: an introducer's unanswered hints at a time, and how long an entry
# whose endpoint never answered is kept after it was last heard of
MAX_HINTS_PER_SOURCE = 4
HINT_TTL_S = 30.0


def ewma(old: float | None, new: float, alpha: float = EWMA) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


@dataclass
class PeerState:
    id: str
    endpoint: str
    incarnation: int
    first_seen: float = field(default_factory=time.monotonic)
    status: str = "alive"  # alive | dead | leaving (said bye, unconfirmed) | left
    ready: bool = False  # has its parameters (joined); only ready peers are partners
    step: int = 0
    samples: int = 0
    last_heard: float | None = None  # last direct message from it
    answered: float | None = None  # last proven message: a reply from its endpoint
    bw: float | None = None  # bytes/s, measured by us
    rtt: float | None = None  # seconds, measured by us
    their_links: dict[str, tuple[float, float]] = field(default_factory=dict)
    served: float | None = None  # its seconds of work per exchange it serves (it reports)
    load: float = 0.0  # exchanges per second it serves (it reports)
    last_exchange: float | None = None
    exchanges: int = 0
    failures: int = 0  # consecutive
    backoff_until: float = 0.0
    drift: float | None = None  # relative disagreement per second of not mixing (EWMA)
    apart: float | None = None  # relative disagreement at the last exchange, either way
    probed: bool = False
    next_ping: float = 0.0  # dead peers are pinged again from this time
    doubted: bool = False  # an unproven goodbye came in its name: the next ping decides
    reached: float | None = None  # last pong from its endpoint to our own ping
    misses: int = 0  # our pings to its endpoint unanswered in a row, while it is alive
    source: str = ""  # who told us of it (introducer or itself): an address, or a key's name

    @property
    def hint(self) -> bool:
        """Only heard of (a peer list): it never spoke to us, its endpoint never answered."""
        return self.last_heard is None and self.reached is None

    @property
    def reachable(self) -> bool | None:
        """Can we reach its endpoint? None: not asked yet."""
        if self.misses >= UNREACHED_AFTER or not self.endpoint:  # "": it listens nowhere
            return False
        return True if self.reached is not None else None


class PeerTable:
    """All state about other peers, behind one lock (read by the averager, the server's
    threads and the heartbeat thread)."""

    def __init__(self, me: str, dead_after: float, penalty_s: float, max_peers: int = 256,
                 queued_bytes: int = 0):  # fmt: skip
        self.me = me
        self.dead_after = dead_after  # the floor: what a fast link gets
        # the most a ping may wait behind on one link, one way: every lane's request and
        # every reply to the other side's lanes, each the largest exchange message
        self.queued_bytes = queued_bytes
        self.penalty_s = penalty_s
        # Bounded: 15,000 fake ids made every heartbeat list them all and steps 4x slower.
        # Full, the least recently heard dead (or gone) entry makes room; a peer heard
        # directly may displace a live one that never completed an exchange with us (the
        # least recently heard), never one that did; a second-hand introduction displaces
        # no live peer.
        self.max_peers = max_peers
        self.lock = threading.RLock()
        self.peers: dict[str, PeerState] = {}
        self.penalties: dict[str, float] = {}  # id -> monotonic time it may be chosen again
        self.tombstones: dict[str, int] = {}  # id -> incarnation that said goodbye
        # id -> (ep, inc, when, who said it): unproven
        self.claims: dict[str, tuple[str, int, float, str]] = {}
        self.forged = 0  # goodbyes and moves refuted by the peer itself
        # may this name be listed or introduced? (keyed groups: it has a key in allowed/)
        self.known: Callable[[str], bool] = lambda pid: True

    # ------------------------------------------------------------ updates
    def heard(self, h: dict[str, Any], proven: bool = False, source: str = "") -> PeerState | None:
        """A validated header straight from its sender: it is alive, at this step.
        `proven`: a reply to our own ping of that name, from the endpoint the header names
        (keyed: that name's key answered there). `source`: who sent it (its address, or its
        key's name), charged for the names its peer list introduces."""
        pid = h["from"]
        if pid == self.me:
            return None
        now = time.monotonic()
        with self.lock:
            if self.tombstones.get(pid) == h["inc"]:
                return None  # a late message from a peer that already said goodbye
            p = self.peers.get(pid)
            if p is not None and (p.endpoint, p.incarnation) != (h["ep"], h["inc"]):
                # the old address holds only while it still answers our own pings: forged
                # pings in its name (its address is public) must not keep a ghost there
                answering = p.answered is not None and now - p.answered <= self.silence(p)
                moving = answering and p.endpoint != h["ep"]
                if not proven or moving:  # check it ourselves (heartbeat.py)
                    if pid in self.claims or len(self.claims) < self.max_peers:
                        self.claims[pid] = (h["ep"], h["inc"], now, source)
                    return None
            elif p is not None and p.status == "leaving" and not proven:
                return None  # only its own endpoint can say it is still here
            if p is None and not self._make_room(live_ok=True):
                return None
            if p is None or p.incarnation != h["inc"]:
                # new, or restarted: its old measurements describe another process
                p = self.peers[pid] = PeerState(pid, h["ep"], h["inc"], source=source)
                self.tombstones.pop(pid, None)
            elif proven and (p.status == "leaving" or p.doubted):
                self.forged += 1  # it answered from its endpoint: the goodbye was not its own
            if proven:
                p.doubted = False
            self.claims.pop(pid, None)
            if p.status != "alive" or p.endpoint != h["ep"]:
                p.misses = 0  # back, or elsewhere: its endpoint is asked afresh
            p.endpoint, p.status, p.last_heard = h["ep"], "alive", now
            if proven:
                p.answered = now
            p.ready, p.step, p.samples = h["ready"], h["step"], h["samples"]
            if "load" in h:
                p.load = h["load"]
            if h.get("served"):
                p.served = h["served"]
            for lid, bw, rtt in h.get("links", []):
                p.their_links[lid] = (bw, rtt)
            for rec in h.get("peers", []):
                self._introduce(rec, source or pid)
            return p

    def _introduce(self, rec: dict[str, Any], source: str) -> None:
        """A name from someone's peer list: a hint ("dead", never listed nor chosen) until
        our own ping reaches it there; a name we know already is not moved by hearsay."""
        pid = rec["id"]
        if pid == self.me or pid in self.peers or self.tombstones.get(pid) == rec["inc"]:
            return
        if not self.known(pid):  # keyed: no key, never dialled nor listed
            return
        hints = sum(p.source == source and p.hint for p in self.peers.values())
        if hints >= MAX_HINTS_PER_SOURCE or not self._make_room(live_ok=False):
            return
        p = PeerState(pid, rec["ep"], rec["inc"], status="dead", ready=rec["ready"])
        p.step, p.source = rec["step"], source
        self.peers[pid] = p

    def _make_room(self, live_ok: bool) -> bool:
        """Room for one more entry (called under the lock); False when there is none."""
        if len(self.peers) < self.max_peers:
            return True
        never = -1.0  # never heard directly: first to go

        def last(p: PeerState) -> float:
            return p.last_heard if p.last_heard is not None else never

        gone = [p for p in self.peers.values() if p.status != "alive"]
        unproven = [p for p in self.peers.values() if p.exchanges == 0]
        pool = gone or (unproven if live_ok else [])
        if not pool:
            return False
        victim = min(pool, key=last)
        del self.peers[victim.id]
        return True

    def left(self, pid: str, inc: int, proven: bool = True) -> bool:
        """A goodbye. Unproven (open groups), the peer is only "leaving" until a ping to
        its endpoint confirms it (nack leaving, or silence) or refutes it (pong); one
        proven alive lately is only doubted (True: ping it soon), and stays a partner."""
        with self.lock:
            p = self.peers.get(pid)
            if not proven:  # never further than "leaving": sweep or the peer itself decides
                if p is None or p.incarnation != inc or p.status != "alive":
                    return False
                now = time.monotonic()
                if p.answered is not None and now - p.answered <= self.silence(p):
                    p.doubted = True  # proven alive: stays a partner until a ping says
                    return True
                p.status, p.ready = "leaving", False
                return True
            if p is not None and p.incarnation == inc:
                p.status, p.ready = "left", False
            if p is None or p.incarnation == inc:
                self.tombstones[pid] = inc
                while len(self.tombstones) > 4 * self.max_peers:
                    del self.tombstones[next(iter(self.tombstones))]
            return False

    def pinged(self, pid: str, answered: bool, heartbeat_s: float) -> None:
        """Our own ping to pid's endpoint was answered from there, or not."""
        now = time.monotonic()
        with self.lock:
            p = self.peers.get(pid)
            if p is None:
                return
            if answered:
                p.reached, p.misses = now, 0
            elif p.status == "alive":  # a dead peer's silence is the sweep's business
                p.misses += 1
                if p.misses >= UNREACHED_AFTER:
                    backoff = heartbeat_s * 2 ** (p.misses - UNREACHED_AFTER + 1)
                    p.next_ping = now + min(REPROBE_MAX_S, backoff)

    def rtt_sample(self, pid: str, seconds: float) -> None:
        with self.lock:
            if pid in self.peers:
                self.peers[pid].rtt = ewma(self.peers[pid].rtt, seconds)

    def bw_sample(self, pid: str, bytes_per_s: float) -> None:
        with self.lock:
            if pid in self.peers:
                self.peers[pid].bw = ewma(self.peers[pid].bw, bytes_per_s)

    def exchanged(
        self, pid: str, nbytes: int, seconds: float, served: float, disagreement: float
    ) -> None:
        """A successful exchange: link speed and how far apart we had drifted."""
        now = time.monotonic()
        with self.lock:
            p = self.peers.get(pid)
            if p is None:
                return
            link_time = seconds - (p.rtt or 0.0) - served
            if link_time > 1e-4:
                p.bw = ewma(p.bw, nbytes / link_time)
            p.served = ewma(p.served, served)
            since = now - (p.last_exchange if p.last_exchange is not None else p.first_seen)
            p.drift = ewma(p.drift, disagreement / max(since, 1e-3))
            p.apart = disagreement
            p.last_exchange, p.exchanges, p.failures, p.backoff_until = now, p.exchanges + 1, 0, 0.0

    def served_exchange(self, pid: str, disagreement: float) -> None:
        """The other direction: it exchanged with us (counts as mixing for selection)."""
        with self.lock:
            p = self.peers.get(pid)
            if p is not None:
                p.last_exchange, p.apart = time.monotonic(), disagreement

    def failed(self, pid: str) -> None:
        """Timeout or refusal: back off exponentially (0.5 s .. 30 s), then try again."""
        with self.lock:
            p = self.peers.get(pid)
            if p is not None:
                p.failures += 1
                p.backoff_until = time.monotonic() + min(30.0, 0.5 * 2 ** (p.failures - 1))

    def busy(self, pid: str) -> None:
        with self.lock:
            p = self.peers.get(pid)
            if p is not None:
                p.backoff_until = time.monotonic() + 0.2

    def penalise(self, pid: str) -> None:
        with self.lock:
            self.penalties.pop(pid, None)  # re-inserted last: the dict stays in expiry order
            self.penalties[pid] = time.monotonic() + self.penalty_s
            while len(self.penalties) > 4 * self.max_peers:  # bounded: the soonest to end go
                del self.penalties[next(iter(self.penalties))]

    def penalised(self, pid: str) -> bool:
        """Sent something refused lately: neither chosen nor served until it ends."""
        with self.lock:
            return time.monotonic() < self.penalties.get(pid, 0.0)

    def sweep(self) -> list[str]:
        """Mark peers we have not heard from as dead; returns the newly dead ids."""
        now = time.monotonic()
        newly = []
        with self.lock:
            for pid, (_, _, when, _) in list(self.claims.items()):
                if now - when > self.dead_after:  # never proven: forget it
                    del self.claims[pid]
            for pid, p in list(self.peers.items()):
                silent = p.last_heard is None or now - p.last_heard > self.silence(p)
                if (p.status == "leaving" or (p.status == "alive" and p.doubted)) and silent:
                    # it said goodbye and stopped answering: it did leave
                    p.status, p.ready = "left", False
                    self.tombstones[pid] = p.incarnation
                if p.status == "alive" and silent:
                    p.status, p.ready, p.misses = "dead", False, 0
                    newly.append(pid)
                heard = p.last_heard if p.last_heard is not None else p.first_seen
                # never answered our ping: someone's word only, kept HINT_TTL_S
                keep = FORGET_AFTER_S if p.reached is not None else HINT_TTL_S
                if p.status != "alive" and now - heard > keep:
                    del self.peers[pid]
        return newly

    def silence(self, p: PeerState) -> float:
        """How long p may be silent before it is dead: dead_after on a fast link; on a slow
        or far one, as long as a ping may wait behind the exchange messages queued on it,
        plus a few round trips, both as measured (a 0.8 MB unit takes 3 s at 2 Mb/s: a 1 s
        dead_after declared such a partner dead while it was sending). Before our own
        ping reached it, nothing is measured: FIRST_CONTACT_S at least (over a far link the
        first handshakes take seconds, and its heartbeat may wait on its probe of us)."""
        wait = SILENT_RTTS * (p.rtt or 0.0)
        if p.bw:
            wait += self.queued_bytes / p.bw
        unmeasured = p.reached is None and p.answered is None
        floor = max(self.dead_after, FIRST_CONTACT_S) if unmeasured else self.dead_after
        return max(floor, min(wait, MAX_DEAD_AFTER_S))

    # ------------------------------------------------------------ queries
    def get(self, pid: str) -> PeerState | None:
        with self.lock:
            return self.peers.get(pid)

    def alive(self) -> list[PeerState]:
        with self.lock:
            return [p for p in self.peers.values() if p.status == "alive"]

    def candidates(self) -> list[PeerState]:
        """Peers we may exchange with now: alive, ready, their endpoint answered our own
        ping (a peer behind NAT is never dialled for an exchange, not even in the heartbeats
        before its misses make it a client: each such try held a unit until its timeout,
        and the clients' own exchanges met that unit busy), not backing off, not
        penalised."""
        now = time.monotonic()
        with self.lock:
            return [
                p
                for p in self.peers.values()
                if p.status == "alive"
                and p.ready
                and p.reachable is True  # a client starts its exchanges itself
                and now >= p.backoff_until
                and now >= self.penalties.get(p.id, 0.0)
            ]

    def ping_targets(self, retry_dead_every: float) -> tuple[list, list]:
        """Whom to ping: (pid, endpoint, once) for peers whose endpoint answered us before
        (alive ones every heartbeat, dead ones now and then, over a socket that dials
        once), and (pid, endpoint, source) for endpoints that never did: entries made from
        a message or a peer list, and claimed moves (heartbeat.py dials those within its
        budget)."""
        now = time.monotonic()
        known, unknown = [], []
        with self.lock:
            for p in self.peers.values():
                if not p.endpoint:
                    continue  # a client with no address: it pings us
                if p.reached is None:  # its own word, or hearsay: not proven yet
                    if p.status != "left" and now >= p.next_ping:
                        unknown.append((p.id, p.endpoint, p.source))
                elif p.status == "alive" and p.reachable is False:
                    if now >= p.next_ping:  # asked again now and then (pinged sets when)
                        known.append((p.id, p.endpoint, False))
                elif p.status in ("alive", "leaving"):
                    known.append((p.id, p.endpoint, False))
                elif p.status == "dead" and now >= p.next_ping:
                    p.next_ping = now + retry_dead_every
                    known.append((p.id, p.endpoint, True))
            unknown += [(pid, ep, src) for pid, (ep, _, _, src) in self.claims.items() if ep]
        return known, unknown

    def unproven(self) -> list[tuple[str, str]]:
        """(id, endpoint) of claims to check with a ping of our own."""
        with self.lock:
            return [(pid, c[0]) for pid, c in self.claims.items() if c[0]]

    def listing(self) -> list[dict[str, Any]]:
        """Alive peers whose endpoint answered our own ping, for our heartbeats (first-hand
        knowledge only: a name we only heard of, or an address not proven, is nobody's
        to dial on our word)."""
        with self.lock:
            return [
                {
                    "id": p.id,
                    "ep": p.endpoint,
                    "inc": p.incarnation,
                    "step": p.step,
                    "ready": p.ready,
                }
                for p in self.peers.values()
                if p.status == "alive" and p.reachable is True and self.known(p.id)
            ][: MAX_LISTED - 1]

    def links(self) -> list[list]:
        with self.lock:
            return [
                [p.id, p.bw or 0.0, p.rtt or 0.0]
                for p in self.peers.values()
                if p.status == "alive" and (p.bw or p.rtt)
            ][:MAX_LISTED]

    def rows(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self.lock:
            return [
                {
                    "id": p.id,
                    "endpoint": p.endpoint,
                    "status": p.status,
                    "ready": p.ready,
                    "step": p.step,
                    "bw": p.bw,
                    "rtt": p.rtt,
                    "last_exchange_s": None if p.last_exchange is None else now - p.last_exchange,
                    "exchanges": p.exchanges,
                    "apart": p.apart,
                    "reachable": p.reachable,
                    "failures": p.failures,
                    "penalised": now < self.penalties.get(p.id, 0.0),
                }
                for p in sorted(self.peers.values(), key=lambda q: q.id)
            ]


@dataclass(frozen=True)
class PeerContext:
    """What a peer's parts (membership, averager) share of the peer itself."""

    header: Callable[[str, int, str], dict[str, Any]]  # (kind, rid, to) -> a message header
    log: logging.LoggerAdapter  # lines prefixed with the peer's id
    stop: threading.Event  # set when the peer closes: every loop ends within its poll
