"""The heartbeat thread: ping every peer we know (and the seeds), probe new links, sweep
the table (membership.py); and how much dialling on other peers' word may cost.

Every endpoint we dial because someone said so (a peer list, a header's `ep`, a claimed
move) and that never answered us is dialled within DialBudget. A new dial (a new socket:
one connection attempt, never redialled, client.py) takes a token from the bucket of its
source (the introducer or claimant: its address in an open group, where names are free,
its key's name in a keyed one; SOURCE_PER_MIN a minute, SOURCE_BURST at once) and one
from a bucket of all (DIALS_PER_MIN, DIAL_BURST), both given back when the endpoint
answers as the peer we asked for; at most DIALS_PER_ROUND new dials a heartbeat,
PER_SOURCE_ROUND on one source's word, sources in turn; an endpoint that did not answer is
not dialled anew for 2, 4, 8 ... heartbeats (at most a minute), and pings while its
socket is open (a far link's handshakes take seconds) cost nothing more. One ping that
listed 151 endpoints (TCP listeners, ipc:// paths, a host name) made a member open about
21,000 connections in 20 s; now, whatever any number of messages or invented ids say, one
source makes a member open at most SOURCE_BURST + SOURCE_PER_MIN (15) connections a
minute to endpoints that never answered it, all sources together DIAL_BURST +
DIALS_PER_MIN (46). The seeds (the user's own --join) are dialled as the user said.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from atom.gossip.membership import REPROBE_MAX_S, PeerContext, PeerState, PeerTable
from atom.gossip.net.client import Client
from atom.gossip.net.transport import Incoming

EARLY_ROUND_S = 0.1  # ping rounds asked for early (check_soon) come no closer than this
GOODBYE_UNREACHED = 4  # peers our pings never reached told goodbye when we leave
DIALS_PER_ROUND = 4  # never-answered endpoints dialled in one heartbeat, all sources
PER_SOURCE_ROUND = 2  # of them, on one source's word
# token buckets of dials to never-answered endpoints: (a minute, at once) in all, and on
# one source's word (an address in an open group, a key's name in a keyed one)
DIALS_PER_MIN, DIAL_BURST = 40.0, 6.0
SOURCE_PER_MIN, SOURCE_BURST = 12.0, 3.0
MAX_KEPT = 1024  # sources and endpoints remembered (the oldest forgotten first)


class DialBudget:
    """Which never-answered endpoints a heartbeat may dial, and what that costs."""

    def __init__(self) -> None:
        now = time.monotonic()
        self._all = [DIAL_BURST, now]  # tokens, when last refilled
        self._sources: dict[str, list[float]] = {}
        self._tried: dict[str, tuple[int, float]] = {}  # endpoint -> (misses, not before)
        self._owed: dict[str, str] = {}  # endpoint dialled, not answered yet -> its source

    @staticmethod
    def _refill(bucket: list[float], per_min: float, burst: float, now: float) -> None:
        bucket[0] = min(burst, bucket[0] + (now - bucket[1]) * per_min / 60.0)
        bucket[1] = now

    def _source(self, source: str, now: float) -> list[float]:
        bucket = self._sources.pop(source, None) or [SOURCE_BURST, now]
        self._sources[source] = bucket  # last: the dict stays in order of use
        while len(self._sources) > MAX_KEPT:
            del self._sources[next(iter(self._sources))]
        self._refill(bucket, SOURCE_PER_MIN, SOURCE_BURST, now)
        return bucket

    def choose(
        self, wanted: list[tuple[str, str, str]], now: float, open_: Callable[[str, str], bool]
    ) -> list[tuple[str, str, bool]]:
        """(pid, endpoint, new) to ping now, from the (pid, endpoint, source) wanted. An
        endpoint whose socket to that peer is open (`open_`: a dial in its handshakes) costs
        nothing more; a new dial is chosen one source at a time in turn, endpoints in
        their backoff left out, and takes a token (the source's and one of all), owed
        until the endpoint answers."""
        self._refill(self._all, DIALS_PER_MIN, DIAL_BURST, now)
        queues: dict[str, list[tuple[str, str]]] = {}
        out: list[tuple[str, str, bool]] = []
        seen = set()
        for pid, ep, source in wanted:
            if ep in seen:
                continue
            seen.add(ep)
            if open_(ep, pid):
                out.append((pid, ep, False))
            elif now >= self._tried.get(ep, (0, 0.0))[1]:
                queues.setdefault(source, []).append((pid, ep))
        dials = 0
        for turn in range(PER_SOURCE_ROUND):
            for source, queue in queues.items():
                if dials >= DIALS_PER_ROUND or self._all[0] < 1:
                    return out
                bucket = self._source(source, now)
                if turn < len(queue) and bucket[0] >= 1:
                    bucket[0] -= 1
                    self._all[0] -= 1
                    pid, ep = queue[turn]
                    self._owed[ep] = source
                    out.append((pid, ep, True))
                    dials += 1
        return out

    def answered(self, endpoint: str) -> None:
        """It answered as the peer we asked for: nobody else's target; tokens back."""
        self._tried.pop(endpoint, None)
        source = self._owed.pop(endpoint, None)
        if source is None:
            return
        self._all[0] = min(DIAL_BURST, self._all[0] + 1)
        bucket = self._sources.get(source)
        if bucket is not None:
            bucket[0] = min(SOURCE_BURST, bucket[0] + 1)

    def unanswered(self, endpoint: str, beat_s: float, now: float) -> None:
        """A new dial not answered in its round: not dialled anew for 2, 4, 8 ...
        heartbeats (at most REPROBE_MAX_S); its open socket may still answer."""
        misses = self._tried.pop(endpoint, (0, 0.0))[0] + 1
        self._tried[endpoint] = (misses, now + min(REPROBE_MAX_S, beat_s * 2**misses))
        while len(self._tried) > MAX_KEPT:
            del self._tried[next(iter(self._tried))]
        while len(self._owed) > MAX_KEPT:
            del self._owed[next(iter(self._owed))]


class Membership:
    """The heartbeat thread: ping everyone known (and the seeds), probe new links, sweep."""

    def __init__(
        self,
        ctx: PeerContext,
        *,
        table: PeerTable,
        client: Client,
        seeds: list[str],
        heartbeat_s: float,
        probe_bytes: int,
        on_tick: Callable[[], None],
        on_verdict: Callable[[str, bool], None] | None = None,
        seed_owner: Callable[[str], str | None] | None = None,
        keyed: bool = False,
    ):
        self.table, self.client, self.header = table, client, ctx.header
        # a member's word on whether it reached our endpoint (a pong's `reach`)
        self.on_verdict = on_verdict or (lambda member, reachable: None)
        self.seeds = list(seeds)
        # keyed: a seed is dialled as the member found there (handshake.SeedWatch)
        self.seed_owner = seed_owner or (lambda endpoint: None)
        self.keyed = keyed
        self.heartbeat_s = heartbeat_s
        self.probe_bytes = probe_bytes
        self.log, self.stop, self.on_tick = ctx.log, ctx.stop, on_tick
        self.budget = DialBudget()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # check_soon

    def ping_header(self, kind: str = "ping", to: str = "") -> dict[str, Any]:
        h = self.header(kind, self.client.next_rid(), to)
        h["peers"] = self.table.listing()
        h["links"] = self.table.links()
        return h

    def ping_round(self, timeout: float | None = None) -> list[PeerState]:
        """Ping every target once (seeds whose owner we do not know yet, and endpoints
        said but not proven, within the budget); returns the peers that answered."""
        now = time.monotonic()
        known, unknown = self.table.ping_targets(retry_dead_every=3 * self.heartbeat_s)
        by_endpoint = {ep: pid for pid, ep, _ in known}  # one ping per endpoint
        once = {ep for _, ep, dials_once in known if dials_once}
        tried, dialled = set(), set()  # endpoints pinged on someone's word; dialled anew
        wanted = [u for u in unknown if u[1] not in by_endpoint]
        for pid, ep, new in self.budget.choose(wanted, now, self.client.holds):
            by_endpoint[ep] = pid
            tried.add(ep)
            if new:
                dialled.add(ep)
        once |= tried
        alive = {p.endpoint for p in self.table.alive() if p.reached is not None}
        items = [(ep, (pid, ep), self.ping_header(to=pid), []) for ep, pid in by_endpoint.items()]
        for ep in self.seeds:
            if ep in alive or ep in by_endpoint:
                continue
            owner = self.seed_owner(ep) if self.keyed else ""
            if owner is None or owner == self.table.me:
                continue  # keyed: nobody to dial it as yet
            if owner:
                by_endpoint[ep] = owner
            items.append((ep, (owner or ep, ep), self.ping_header(to=owner), []))
        sent = time.monotonic()
        replies = self.client.request_many(items, timeout or max(0.5, self.heartbeat_s), once)
        answered = []
        for ep, reply in replies.items():
            addressed = by_endpoint.get(ep)  # None: a seed whose owner we do not know yet
            h = reply.header if reply is not None else None
            # keyed, the reply came over addressed's key (client.py checks `from` too);
            # open, it is someone at ep: either way, proof only from where it says it is
            proof = h is not None and h["ep"] == ep and h["from"] == (addressed or h["from"])
            if ep in tried and proof and h["kind"] in ("pong", "nack"):
                self.budget.answered(ep)
            elif ep in dialled:
                self.budget.unanswered(ep, self.heartbeat_s, now)
            if h is None or (addressed is not None and h["from"] != addressed):
                known_p = self.table.get(addressed) if addressed is not None else None
                if known_p is not None and known_p.endpoint == ep:  # not a claim's address
                    self.table.pinged(addressed, False, self.heartbeat_s)
                continue
            if "reach" in h:
                self.on_verdict(h["from"], h["reach"])
            if h["kind"] == "nack" and h.get("reason") == "leaving":
                known_p = self.table.get(h["from"])
                if proof and known_p is not None and known_p.endpoint == ep:
                    self.table.left(h["from"], h["inc"])
                continue
            if h["kind"] != "pong":
                continue
            source = h["from"] if self.keyed else reply.address
            p = self.table.heard(h, proven=proof, source=source)
            now_at = self.table.get(h["from"])  # after heard: it may have made the entry
            if now_at is not None and now_at.endpoint == ep:  # its endpoint answers
                self.table.pinged(h["from"], True, self.heartbeat_s)
            if p is not None:
                self.table.rtt_sample(p.id, reply.received - sent)
                answered.append(p)
        return answered

    def probe(self, p: PeerState) -> None:
        """One bandwidth sample from a probe of probe_bytes: time minus the round trip."""
        p.probed = True
        payload = bytes(self.probe_bytes)
        h = self.header("probe", self.client.next_rid(), p.id)
        h["tensors"] = [{"dtype": "u8", "n": len(payload)}]
        t0 = time.monotonic()
        reply = self.client.request(p.endpoint, (p.id, p.endpoint), h, [payload], timeout=5.0)
        if reply is None or reply.header["kind"] != "ack":
            return
        link = (reply.received - t0) - (p.rtt or 0.0)
        if link > 1e-4:
            self.table.bw_sample(p.id, len(payload) / link)

    def tick(self) -> None:
        self.ping_round()
        for p in self.table.alive():
            # only an endpoint that answered our ping: a probe of someone's word would be a
            # dial outside the budget
            if not p.probed and p.endpoint and p.reached is not None and not self.stop.is_set():
                self.probe(p)
                break  # one probe per heartbeat keeps a tick short
        for pid in self.table.sweep():
            self.log.warning("peer %s stopped answering: skipped, retried later", pid)

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            self._wake.clear()
            try:
                self.tick()
                self.on_tick()
            except Exception:
                self.log.exception("heartbeat failed")
            self._wake.wait(max(0.05, self.heartbeat_s - (time.monotonic() - started)))
            # woken early (check_soon): not sooner than EARLY_ROUND_S after the last round
            self.stop.wait(max(0.0, EARLY_ROUND_S - (time.monotonic() - started)))

    def check_soon(self) -> None:
        """Ping round now (within EARLY_ROUND_S), not at the next heartbeat: an unproven
        goodbye is settled by the peer's own answer, and that should not take a second."""
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="atom-gossip-heartbeat", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 5.0) -> None:
        self._wake.set()  # out of its wait: `stop` is set
        if self._thread is not None:
            self._thread.join(timeout)

    def goodbye(self, client: Client, timeout: float = 1.0) -> set[str]:
        """Tell every alive peer whose endpoint answered our pings that we are leaving, and
        at most GOODBYE_UNREACHED of those it has not (one connection attempt each, those
        that exchanged with us first, then the most recently heard: a peer that joined a
        moment ago): every name an attacker pinged us in is alive, and a goodbye to each
        was 187 dials on its word at one peer's end (tools/bench/attacks.py dialer);
        returns the ids that acknowledged."""
        alive = [p for p in self.table.alive() if p.endpoint]
        unreached = sorted(
            (p for p in alive if p.reached is None),
            key=lambda p: (p.exchanges > 0, p.last_heard or 0.0),
            reverse=True,
        )
        keep = {p.id for p in unreached[:GOODBYE_UNREACHED]}
        alive = [p for p in alive if p.reached is not None or p.id in keep]
        items = [
            (p.endpoint, (p.id, p.endpoint), self.header("bye", client.next_rid(), p.id), [])
            for p in alive
        ]
        if not items:
            return set()
        once = {p.endpoint for p in alive if p.reached is None}
        replies = client.request_many(items, timeout, once)
        return {p.id for p in alive if replies.get(p.endpoint) is not None}


def handle_control(
    table: PeerTable,
    incoming: Incoming,
    bound: bool,
    on_doubt: Callable[[], None],
) -> str | None:
    """Server side of ping / probe / bye: update the table; the reply kind to send.
    `bound`: the sender's name is its connection's key (a keyed group): its goodbye is its
    own; its address, as in an open group, only a claim until our own ping proves it.
    `on_doubt`: called for an unproven goodbye of a peer proven alive (check it now)."""
    h = incoming.header
    kind = h["kind"]
    if kind == "bye":
        if table.left(h["from"], h["inc"], bound):
            on_doubt()
        return "ack"
    table.heard(h, proven=False, source=h["from"] if bound else incoming.address)
    return {"ping": "pong", "probe": "ack"}.get(kind)
