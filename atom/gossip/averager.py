"""The averager: push-pull exchanges of one unit at a time, and their server side.

Initiator (one background thread): pick a unit (round robin; with diloco only units
whose H inner steps are done), pick a partner (selection.py), then

    snapshot our unit -> encode -> xreq ......> partner: decode + check, snapshot its unit,
                                                reply with it (int8: as a delta against
                                                our request), merge ours into its own
    xrep <....................................
    decode + check -> merge theirs into ours

Each side merges only a message it received whole and validated (sizes, fingerprint,
finite values): a timeout, a dead partner, a truncated or poisoned reply changes
nothing on our side. A unit takes part in one exchange at a time (`busy` otherwise), so
two concurrent averages never compound on the same weights. The training thread never
waits for any of this: merges take the unit's lock for one add + refresh, as long as a
host-to-device copy of that unit.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from atom.config import ConfigError
from atom.gossip.budget import UNPROVEN, ServeBudget
from atom.gossip.membership import SILENT_RTTS, PeerContext, PeerState, PeerTable, ewma
from atom.gossip.merge import GossipMerge, UnitParams, relative_disagreement
from atom.gossip.net.client import Client
from atom.gossip.net.codecs import Codec, decode_checked, get_codec
from atom.gossip.net.counters import Counters
from atom.gossip.net.transport import Incoming, Reply
from atom.gossip.net.wire import Rejected
from atom.gossip.pairref import REF_NACK, PairRefs
from atom.gossip.robust import DiffGuard, Judgement, safe_beta
from atom.gossip.selection import Selector
from atom.gossip.session import ReplySession, RequestSession

MIN_BW = 1e6  # bytes/s assumed when sizing the timeout of a transfer to an unmeasured link
MAX_TRANSFER_S = 600.0  # however slow a partner's link looks, a lane waits no longer
STRATEGY_NACK = "this peer's strategy is"


class GossipError(ConfigError):
    """Joining failed in a way the user must fix (address, firewall, key): one line, exit 2."""


class Averager:
    def __init__(
        self,
        ctx: PeerContext,
        *,
        params: UnitParams,
        table: PeerTable,
        selector: Selector,
        merge: GossipMerge,  # or a subclass: diloco, noloco
        codec: Codec,
        make_client: Callable[[], Client],  # one per thread (zmq sockets are not shared)
        counters: Counters,
        weight: Callable[[], float],  # this peer's averaging weight (samples trained on)
        on_reject: Callable[[Rejected, str], None],
        interval_s: float,
        timeout_s: float,
        lanes: int,
        guard: DiffGuard | None = None,
        refs: PairRefs | None = None,
    ):
        self.params, self.table, self.selector, self.merge = params, table, selector, merge
        # unit -> the merge's state parts pulled while joining (diloco: outer optimizer)
        self.pulled_parts: dict[int, dict[str, tuple[torch.Tensor, dict]]] = {}
        self.codec, self.make_client, self.counters = codec, make_client, counters
        self.header, self.weight = ctx.header, weight
        self.interval_s, self.timeout_s, self.lanes = interval_s, timeout_s, lanes
        self.on_reject, self.log, self.stop = on_reject, ctx.log, ctx.stop
        self.ready = threading.Event()  # set once we hold the group's parameters
        self.work_s: float | None = None  # our seconds of work per exchange (EWMA)
        self._busy: set[int] = set()  # units in an exchange (either direction)
        self._inflight: set[str] = set()  # partners we are exchanging with
        self._busy_lock = threading.Lock()
        self._next = 0
        self._next_start = 0.0  # the lanes share one start rate: interval_s
        self._served: collections.deque[float] = collections.deque(maxlen=256)
        self._warned: set[str] = set()  # partners told of a strategy mismatch
        self.guard = guard or DiffGuard()  # refuses (or clips) what a bad peer sends
        self.refs = refs or PairRefs(4)  # pairs' shared references (codec topk)
        # how far the peers that ask may move each unit over time (budget.py)
        self.budget = ServeBudget(*merge.schedule(interval_s, len(params.units)))
        self._threads: list[threading.Thread] = []
        self._local = threading.local()
        self._clients: list[Client] = []

    @property
    def client(self) -> Client:
        """This thread's client (zmq sockets must not cross threads)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self.make_client()
            with self._busy_lock:
                self._clients.append(client)
        return client

    # ------------------------------------------------------------ bookkeeping
    def _claim(self, unit: int) -> bool:
        with self._busy_lock:
            if unit in self._busy:
                return False
            self._busy.add(unit)
            return True

    def _release(self, unit: int) -> None:
        with self._busy_lock:
            self._busy.discard(unit)

    def note_served(self) -> None:
        """One exchange served (a server worker calls it; load() reads on the I/O thread:
        unlocked, that read once failed with "deque mutated during iteration")."""
        with self._busy_lock:
            self._served.append(time.monotonic())

    def load(self) -> float:
        """Exchanges we served per second over the last 10 s (shared in heartbeats)."""
        now = time.monotonic()
        with self._busy_lock:  # served exchanges append from the server's workers
            return sum(1 for t in self._served if now - t < 10.0) / 10.0

    def _timeout(self, p: PeerState | None, nbytes: int) -> float:
        """timeout_s, plus the time the link takes for nbytes at half its measured speed
        (MIN_BW until measured) and a few of its round trips. MIN_BW once floored the
        measured speed too: 0.8 MB each way over 1 Mb/s was given 13.2 s, about what it
        takes with nothing else on the link."""
        measured = p is not None and p.bw
        bw = 0.5 * p.bw if measured else MIN_BW
        rtt = p.rtt if p is not None and p.rtt else 0.0
        return self.timeout_s + SILENT_RTTS * rtt + min(2 * nbytes / bw, MAX_TRANSFER_S)

    def _pick_unit(self) -> int | None:
        units = self.params.units
        with self._busy_lock:
            for k in range(len(units)):
                u = units[(self._next + k) % len(units)]
                if self.merge.due(u) and u not in self._busy:
                    self._next = (self._next + k + 1) % len(units)
                    return u
        return None

    # ------------------------------------------------------------ initiator
    def run(self) -> None:
        """One lane. Lanes run exchanges side by side (never two with one partner or on one
        unit), so a transfer crawling over a slow link does not stop mixing over the fast
        ones; together they start at most one exchange per interval_s."""
        while not self.stop.is_set():
            with self._busy_lock:
                now = time.monotonic()
                start = max(now, self._next_start)
                self._next_start = start + self.interval_s
            if self.stop.wait(max(0.0, start - now)):
                break
            did = False
            if self.ready.is_set():
                try:
                    did = self.step_once()
                except Exception:
                    self.log.exception("exchange failed unexpectedly")
            if not did:
                self.stop.wait(0.1)  # nothing to do (no partner, no unit due): look again soon

    def step_once(self) -> bool:
        unit = self._pick_unit()
        if unit is None:
            return False
        nbytes = self.codec.wire_bytes(self.params.numel(unit))
        with self._busy_lock:
            free = [p for p in self.table.candidates() if p.id not in self._inflight]
        partner = self.selector.choose(free, nbytes)
        if partner is None:
            return False
        return self.exchange(partner, unit)

    def exchange(self, partner: PeerState, unit: int) -> bool:
        """One push-pull of `unit` with `partner`; True if both halves were applied."""
        with self._busy_lock:
            if unit in self._busy or partner.id in self._inflight:
                return False
            self._busy.add(unit)
            self._inflight.add(partner.id)
        try:
            return self._exchange(partner, unit)
        finally:
            with self._busy_lock:
                self._busy.discard(unit)
                self._inflight.discard(partner.id)

    def _exchange(self, partner: PeerState, unit: int) -> bool:
        t0 = time.monotonic()
        snap = self.params.snapshot(unit)
        mine = self.merge.payload(unit, snap)  # the weights, or noloco's [outer; pseudo-grad]
        h = self.header("xreq", self.client.next_rid(), partner.id)
        n_pay = self.merge.payload_numel(self.params.numel(unit))
        session = RequestSession(self.codec, self.refs, partner.id, unit, h["rid"], n_pay)
        fields, buffers = session.encode(mine)
        h.update(fields, unit=unit, weight=self.weight())
        if self.merge.payload_kind != "weights":
            h["payload"] = self.merge.payload_kind
        work = time.monotonic() - t0
        nbytes = sum(b.nbytes for b in buffers)
        reply = self.client.request(
            partner.endpoint,
            (partner.id, partner.endpoint),
            h,
            buffers,
            self._timeout(partner, 2 * nbytes),
            abort=lambda: partner.status != "alive",
        )
        t_reply = time.monotonic()
        if reply is None:
            self.counters.inc("exchange.failed")
            self.table.failed(partner.id)
            self.log.debug("exchange of unit %d with %s failed (no valid reply)", unit, partner.id)
            return False
        rh = reply.header
        if rh["from"] == partner.id and rh["kind"] == "nack" and rh.get("reason") == REF_NACK:
            session.abandon()  # it holds another reference: dense next time
            self.counters.inc("exchange.resync")
            return False
        if rh["from"] != partner.id or rh["kind"] in ("busy", "nack"):
            self.counters.inc(f"exchange.{'busy' if rh['kind'] == 'busy' else 'refused'}")
            self._warn_strategy(partner.id, rh)
            (self.table.busy if rh["kind"] == "busy" else self.table.failed)(partner.id)
            return False
        t1 = time.monotonic()
        try:
            if rh["kind"] != "xrep" or rh["unit"] != unit:
                raise Rejected("schema", f"answered {rh['kind']} unit {rh.get('unit')} to xreq")
            if rh.get("payload", "weights") != self.merge.payload_kind:
                raise Rejected("schema", f"answered a {rh.get('payload', 'weights')} payload")
            remote = session.decode(rh, reply.frames)
            diff, remote, disagreement, judged = self._judge(
                unit, snap, mine, remote, partner.id, session.sparse
            )
        except Rejected as err:
            session.abandon()  # the partner moved its reference on, we do not
            err.sender = partner.id
            self.on_reject(err, reply.address)
            self.counters.inc("exchange.failed")
            return False
        w_me, w_them = self.weight(), rh["weight"]
        trust = judged.trust
        beta = safe_beta(w_me, w_them) * trust
        self.budget.moved(unit, _norm(snap), beta * disagreement**0.5)
        self.merge.merge(unit, snap, diff, beta, remote, trust < 1)
        session.commit()
        work += time.monotonic() - t1
        self.work_s = ewma(self.work_s, work)
        self.table.exchanged(
            partner.id,
            nbytes + reply.nbytes,
            t_reply - t0 - work,
            rh.get("served", 0.0),
            disagreement,
        )
        self.counters.inc("exchange.ok")
        self.counters.inc("exchange.bytes", nbytes + reply.nbytes)
        return True

    def _warn_strategy(self, pid: str, reply: dict) -> None:
        """Once per partner: a member of another strategy refuses every exchange (the
        default changed from plain averaging to the outer optimizer on 2026-11-26), which
        otherwise shows only as a counter."""
        reason = str(reply.get("reason", ""))
        if reply["kind"] != "nack" or not reason.startswith(STRATEGY_NACK):
            return
        with self._busy_lock:
            if pid in self._warned or len(self._warned) > 1024:
                return
            self._warned.add(pid)
        self.log.warning("%s refuses our exchanges: %s, ours is %s; no mixing with it "
                         "until gossip.strategy matches across the group", pid, reason,
                         self.merge.name)  # fmt: skip

    def _judge(self, unit: int, snap: torch.Tensor, mine: torch.Tensor, remote: torch.Tensor,
               sender: str, sparse: bool = False, chosen: bool = True,
               ) -> tuple[torch.Tensor, torch.Tensor | None, float, Judgement]:  # fmt: skip
        """(diff = their weights - ours; their payload (None when it is the weights: diff
        says it all); how far apart the two are as far as we let it in (squared, relative to
        the unit's norm); the judgement: the sender's trust as it left it, and the yardstick
        it was judged by), after the robust merge clipped or refused (Rejected) the
        payloads' difference. `chosen`: we started the exchange, with a partner we picked;
        only those set the yardstick (a request's size is judged, not kept). The whole
        payload is judged, not only the weights it implies: noloco's outer weights and
        pseudo-gradient could each be huge and still imply harmless weights. A top-k
        exchange (`sparse`) is judged against the other partners' top-k exchanges of the
        unit: it carries only the largest moves, so beside dense exchanges' full
        disagreement it would look small, and a dense one (a pair's first) beside sparse
        ones would be clipped and its partner distrusted."""
        pdiff = remote.sub_(mine)  # no copy: the payload itself is not needed again
        first = lambda: self.merge.first_scale(unit, snap)  # noqa: E731  (only when needed)
        key = ~unit if sparse else unit  # the guard's history: -1 - unit for top-k
        if self.merge.payload_kind == "weights":
            # clipped in place, or refused
            judged = self.guard.admit(key, snap, pdiff, sender, first, record=chosen)
            # after the clip: what this exchange could remove (the selector's drift)
            return pdiff, None, relative_disagreement(snap, pdiff), judged
        judged = self.guard.admit(key, mine, pdiff, sender, first, record=chosen)
        remote = pdiff.add_(mine)
        diff = self.merge.weights_of(remote, snap.numel()) - snap
        return diff, remote, relative_disagreement(snap, diff), judged

    # ------------------------------------------------------------ responder
    def _budget_key(self, sender: str) -> str:
        """Whom a served exchange counts against: the sender, once its own endpoint has
        answered our ping; before that (a client, an id nobody listens for), UNPROVEN,
        one allowance for all of them."""
        p = self.table.get(sender)
        proven = p is not None and p.status == "alive" and p.endpoint and p.reached is not None
        return sender if proven else UNPROVEN

    def serve_exchange(self, incoming: Incoming) -> Reply:
        """Server side of xreq (runs on a server worker thread)."""
        h = incoming.header
        base = self.header("xrep", h["rid"], h["from"])
        if not self.ready.is_set():
            return _refuse(base, "nack", "joining: no parameters yet")
        unit = h["unit"]
        if unit not in self.params.units:
            raise Rejected("schema", f"unit {unit} owns no parameters")
        if self.table.penalised(h["from"]):  # it sent something refused: not served either
            self.counters.inc("served.refused")
            return _refuse(base, "nack", "penalised: an earlier message was refused")
        kind = self.merge.payload_kind
        if h.get("payload", "weights") != kind:  # a group of mixed strategies: not its fault
            self.counters.inc("served.refused")
            return _refuse(base, "nack", f"{STRATEGY_NACK} {self.merge.name}")
        if not self.merge.servable(unit):  # as good as due: an attacker may not set the pace
            self.counters.inc("served.not_due")
            return _refuse(base, "busy", "unit not due by this peer's schedule", unit)
        if not self._claim(unit):
            self.counters.inc("served.busy")
            return _refuse(base, "busy", "unit in another exchange", unit)
        sender = self._budget_key(h["from"])
        over = self.budget.admit(unit, sender)
        if over is not None:
            self._release(unit)
            self.counters.inc("served.budget")
            return _refuse(base, "busy", over, unit)
        try:
            # our own codec where it is the request's (topk: our fraction for the reply)
            codec = self.codec if h["codec"] == self.codec.name else get_codec(h["codec"])
            n_pay = self.merge.payload_numel(self.params.numel(unit))
            session = ReplySession.open(codec, self.codec, self.refs, h, unit, n_pay)
            if session is None:  # not the reference the request was built on
                self._release(unit)
                self.counters.inc("served.resync")
                return _refuse(base, "nack", REF_NACK)
            remote = session.decode(incoming.frames)
            snap = self.params.snapshot(unit)
            mine = self.merge.payload(unit, snap)
            fields, buffers, remote = session.reply(mine, remote)
            # trust below 1: clipped lately (not to build on); as judged, not after the
            # reply: another exchange with the same partner may be judged meanwhile
            diff, remote, apart, judged = self._judge(unit, snap, mine, remote, h["from"],
                                                      session.sparse, chosen=False)  # fmt: skip
        except BaseException:
            self._release(unit)
            raise
        w_me, w_them = self.weight(), h["weight"]
        trust = judged.trust
        beta = safe_beta(w_me, w_them) * trust
        # the unit's window of served movement (budget.py): beyond it, not merged at all
        if not self.budget.allow_move(unit, sender, beta * apart**0.5, judged.typical):
            self._release(unit)  # no reference moves on either side: a busy changes nothing
            self.counters.inc("served.moved")
            return _refuse(base, "busy", f"unit {unit} moved enough this window", unit)
        base.update(fields, unit=unit, weight=w_me)
        if kind != "weights":
            base["payload"] = kind
        base["served"] = time.monotonic() - incoming.received

        def apply() -> None:  # after the reply is on its way: merging is off the critical path
            try:
                self.budget.moved(unit, _norm(snap), beta * apart**0.5)
                self.merge.merge(unit, snap, diff, beta, remote, trust < 1)
                session.commit()
                self.table.served_exchange(h["from"], apart)
                self.note_served()
                self.counters.inc("served.ok")
            finally:
                self._release(unit)

        return base, buffers, apply

    def serve_state(self, incoming: Incoming) -> Reply:
        """Server side of sreq: a joining peer copies one unit, exactly (fp32)."""
        h = incoming.header
        base = self.header("srep", h["rid"], h["from"])
        if not self.ready.is_set():
            return _refuse(base, "nack", "joining: no parameters yet")
        unit = h["unit"]
        if unit not in self.params.units:
            raise Rejected("schema", f"unit {unit} owns no parameters")
        part = h.get("part", "weights")
        if part == "weights":
            values = self.params.snapshot(unit)
        elif part in self.merge.state_parts:  # e.g. diloco's outer optimizer
            values, fields = self.merge.state_part(unit, part)
            base.update(fields)
        else:
            return _refuse(base, "nack", f"no {part}: this peer's strategy is {self.merge.name}")
        metas, buffers = get_codec("fp32").encode(values)
        base.update(unit=unit, codec="fp32", weight=self.weight(), tensors=metas, part=part)
        self.counters.inc("served.state")
        return base, buffers

    # ------------------------------------------------------------ join
    def pull_state(
        self, sources: Callable[[], list[PeerState]], patience_s: float
    ) -> tuple[int, int, str]:
        """Copy every unit from ready members (in the caller's thread, before training).
        A member that fails is skipped for the next; we give up when no member could
        deliver a unit for patience_s. Returns (step, samples, source id)."""
        step = samples = None
        source = ""
        for unit in self.params.units:
            deadline = time.monotonic() + patience_s
            skip: set[str] = set()
            while True:
                if self.stop.is_set():
                    raise GossipError("stopped while joining")
                if time.monotonic() > deadline:
                    raise GossipError(
                        f"could not download unit {unit} from any member within {patience_s:.0f}s"
                    )
                ready = [p for p in sources() if p.id not in skip]
                if not ready:  # everyone failed once (or nobody is ready): wait, then retry all
                    skip.clear()
                    self.stop.wait(0.5)
                    continue
                p = ready[0]
                got = self._pull_unit(p, unit)
                if got is None:
                    skip.add(p.id)
                    continue
                if step is None:
                    step, samples, source = got[0], got[1], p.id
                break
        return step or 0, samples or 0, source

    def _pull_part(self, p: PeerState, unit: int, part: str):
        """One part of a unit's state from p: (values, reply header) or None."""
        h = self.header("sreq", self.client.next_rid(), p.id)
        h.update(unit=unit, part=part)
        n = self.params.numel(unit)
        reply = self.client.request(p.endpoint, (p.id, p.endpoint), h, [], self._timeout(p, 4 * n))
        if reply is None or reply.header["kind"] != "srep":
            return None
        rh = reply.header
        try:
            if rh["unit"] != unit or rh["codec"] != "fp32" or rh.get("part", "weights") != part:
                raise Rejected("schema", "state reply for another unit, codec or part")
            return decode_checked(get_codec("fp32"), rh["tensors"], reply.frames, n), rh
        except Rejected as err:
            err.sender = p.id
            self.on_reject(err, reply.address)
            return None

    def _pull_unit(self, p: PeerState, unit: int) -> tuple[int, int] | None:
        got = self._pull_part(p, unit, "weights")
        if got is None:
            self.log.info("%s could not serve unit %d; trying another member", p.id, unit)
            return None
        values, rh = got
        self.params.load(unit, values)
        parts = {part: self._pull_part(p, unit, part) for part in self.merge.state_parts}
        if parts and all(got is not None for got in parts.values()):  # a member of our kind
            self.pulled_parts[unit] = parts
        return rh["step"], rh["samples"]

    # ------------------------------------------------------------ thread
    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self.run, name=f"atom-gossip-lane-{i}", daemon=True)
            for i in range(self.lanes)
        ]
        for t in self._threads:
            t.start()

    def join(self, timeout: float = 10.0) -> None:
        for t in self._threads:
            t.join(timeout)

    def close_clients(self) -> None:
        """After the lanes have stopped: close every thread's sockets."""
        with self._busy_lock:
            clients, self._clients = self._clients, []
        for c in clients:
            c.close()


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def _refuse(header: dict[str, Any], kind: str, reason: str, unit: int | None = None) -> Reply:
    header["kind"] = kind
    header["reason"] = reason
    if kind == "busy":
        header["unit"] = unit or 0
    return header, []
