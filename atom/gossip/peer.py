"""GossipPeer: one peer of a group, wired to a SwapEngine; the Trainer's hooks.

    peer = attach_gossip(cfg, engine, run_dir, start_step)   # listen, join, pull state
    ... train; peer.after_step(step) after every optimizer step ...
    peer.close()                                             # goodbye, threads, sockets

Threads: the server's I/O thread and its workers (transport.py), the heartbeat thread
(membership.py), the averager (averager.py). Each owns its own sockets; they share the
PeerTable, the counters and this object's step. Shutdown stops the threads first, then
says goodbye (so no exchange is half done), then closes every socket with LINGER 0.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import zmq

from atom.config import Config, ConfigError
from atom.config.gossip import GossipConfig, endpoint_host, is_loopback, parse_rates
from atom.gossip.averager import Averager, GossipError
from atom.gossip.heartbeat import Membership, handle_control
from atom.gossip.membership import PeerContext, PeerState, PeerTable
from atom.gossip.merge import UnitParams, make_merge
from atom.gossip.net.client import Client
from atom.gossip.net.codecs import get_codec
from atom.gossip.net.counters import Counters, LogLimiter
from atom.gossip.net.handshake import SeedWatch, no_member_line, refused_everywhere
from atom.gossip.net.keys import GroupKeys, check_seed_names, load_bundle, start_authenticator
from atom.gossip.net.replay import RequestIds
from atom.gossip.net.shaping import LinkShaper
from atom.gossip.net.transport import MISMATCHES, Incoming, Reply, Server
from atom.gossip.net.wire import PROTOCOL, Expect, Rejected
from atom.gossip.pairref import PairRefs
from atom.gossip.reach import Reachability
from atom.gossip.robust import DiffGuard
from atom.gossip.selection import make_selector
from atom.gossip.status import PeerLog, write_status
from atom.ground.engine_protocol import SharedUnit

log = logging.getLogger(__name__)
SUMMARY_EVERY_S = 60.0  # a one-line view of the group in the log (atom peers has the table)
# after a goodbye in an open group, how long to stay answering `nack leaving` to the pings
# that check it (a goodbye nobody can prove only makes a peer that answered lately doubted)
LINGER_S = 1.0


def default_name() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40] or "peer"
    return f"{host}-{secrets.token_hex(2)}"


def _lan_address() -> str:
    """This machine's address on its default route (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def advertised(bound: str) -> str:
    host = endpoint_host(bound)
    if host in ("0.0.0.0", "::", "*"):
        return f"tcp://{_lan_address()}:{bound.rsplit(':', 1)[1]}"
    return bound


_MISMATCH_FIX = {
    "fingerprint": "its members train a different model (parameter names, shapes or dtypes): "
    "use the group's --config and --set model.* values",
    "group": "it is another group: use the group's --group-key (or none, as it does)",
    "version": "it speaks another protocol version: run the same atom version as the group",
}


def _refusal_message(address: str, err: Rejected) -> str:
    where = f"the member at {address}" if address else "a group member"
    return f"{where} refused this peer ({err.detail or err.reason}); {_MISMATCH_FIX[err.reason]}"


class GossipPeer:
    def __init__(
        self,
        gcfg: GossipConfig,
        params: UnitParams,
        run_dir: Path | None = None,
        start_step: int = 0,
        samples_per_step: int = 1,
    ):
        if not gcfg.enabled:
            raise ConfigError("gossip needs --listen tcp://HOST:PORT, or --join to be a client")
        self.cfg = gcfg
        self.params = params
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.keys: GroupKeys | None = load_bundle(gcfg.group_key) if gcfg.group_key else None
        if self.keys and gcfg.name and gcfg.name != self.keys.name:
            raise ConfigError(
                f"gossip.name {gcfg.name!r} differs from the group key's name "
                f"{self.keys.name!r}: in a keyed group a peer is named by its key; drop --name"
            )
        self.id = gcfg.name or (self.keys.name if self.keys else default_name())
        check_seed_names(self.keys, gcfg.seed_names)  # --join NAME@...: NAME has a key
        self._seeds: SeedWatch | None = None  # while joining: who listens at each seed
        self.incarnation = secrets.randbits(62)
        self.group = self.keys.group_id if self.keys else f"open:{gcfg.group}"[:64]
        self.log = PeerLog(log, {"peer": self.id})
        self.limiter = LogLimiter(self.log)
        largest = max(params.numel(u) for u in params.units)
        if gcfg.strategy == "noloco":  # its payload: outer weights and pseudo-gradient
            largest *= 2
        self.max_bytes = (
            int(gcfg.max_message_mb * 2**20)
            if gcfg.max_message_mb > 0
            else int(1.25 * 4 * largest) + 2**20
        )
        self.expect = Expect(self.group, params.fingerprint, params.n_units)
        self.step = self.base_step = start_step
        self.samples_per_step = samples_per_step
        self.base_samples = start_step * samples_per_step
        self.joined_from = ""
        self.counters = Counters()
        self.rids = RequestIds()  # every client's: unguessable, replays refused
        self.leaving = False  # saying goodbye: pings are answered `nack leaving`
        self._checked_leaving: set[str] = set()  # who pinged us since (and was told so)
        self.stop = threading.Event()  # background loops and their network waits
        self.ctx = zmq.Context()
        self.auth = None
        self.shaper = LinkShaper(gcfg.link_mbps, parse_rates(gcfg.link_mbps_to))
        codec = get_codec(gcfg.codec, gcfg.topk_fraction)
        queued = 2 * max(gcfg.lanes, 1) * codec.wire_bytes(largest)
        self.table = PeerTable(self.id, gcfg.dead_after_s, gcfg.penalty_s, gcfg.max_peers, queued)
        if self.keys is not None:  # a name without a key is never listed nor dialled
            self.table.known = lambda pid: self.keys.key_of(pid) is not None
        self.join_refusal: tuple[str, Rejected] | None = None  # who refused us, and why
        self.merge = make_merge(gcfg.strategy, params, gcfg)
        guard = DiffGuard(gcfg.clip_factor, gcfg.reject_factor, gcfg.max_relative)
        self.selector = make_selector(
            gcfg.selection, self.id, gcfg.explore, my_work=lambda: self.averager.work_s or 0.0,
            trust=guard.trust,
        )  # fmt: skip
        self._heartbeat_client = self._client(self.stop)
        ctx = PeerContext(header=self._header, log=self.log, stop=self.stop)
        self.averager = Averager(
            ctx,
            params=params,
            table=self.table,
            selector=self.selector,
            merge=self.merge,
            codec=codec,
            make_client=lambda: self._client(self.stop),
            counters=self.counters,
            weight=self.weight,
            on_reject=self._on_reject,
            interval_s=gcfg.interval_s,
            timeout_s=gcfg.timeout_s,
            lanes=gcfg.lanes,
            guard=guard,
            refs=PairRefs(gcfg.topk_partners),
        )
        self.membership = Membership(
            ctx,
            table=self.table,
            client=self._heartbeat_client,
            seeds=gcfg.seeds,
            heartbeat_s=gcfg.heartbeat_s,
            probe_bytes=min(gcfg.probe_kb * 1024, self.max_bytes // 2),
            on_tick=self.write_status,
            on_verdict=lambda member, ok: self.reach.verdict(member, ok),
            seed_owner=self._seed_owner,
            keyed=self.keys is not None,
        )
        self.reach = Reachability(self.log)  # member or client: what the members say
        self.server: Server | None = None
        self.endpoint = ""
        self.closed = False
        self._status_lock = threading.Lock()
        self._last_summary = time.monotonic()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    # ------------------------------------------------------------ plumbing
    def _client(self, stop: threading.Event) -> Client:
        return Client(
            self.ctx, self.keys, self.expect, self.max_bytes, self.shaper, self.counters,
            self._on_reply_reject, stop, self.id, self.rids,
        )  # fmt: skip

    @property
    def samples(self) -> int:
        return self.base_samples + max(0, self.step - self.base_step) * self.samples_per_step

    def weight(self) -> float:
        """An exchange averages weighted by samples trained on (a newcomer counts less)."""
        return float(max(self.samples, 1))

    def _header(self, kind: str, rid: int, to: str = "") -> dict[str, Any]:
        h = {
            "v": PROTOCOL,
            "kind": kind,
            "group": self.group,
            "fp": self.params.fingerprint,
            "from": self.id,
            "to": to,
            "inc": self.incarnation,
            "ep": self.endpoint,
            "rid": rid,
            "step": self.step,
            "samples": self.samples,
            "ready": self.averager.ready.is_set(),
        }
        if kind in ("ping", "pong"):
            h["load"] = self.averager.load()
            h["served"] = self.averager.work_s or 0.0
        return h

    def _reply_header(self, incoming: Incoming, kind: str) -> dict[str, Any]:
        return self._header(kind, incoming.header["rid"], incoming.header["from"])

    def _inline(self, incoming: Incoming) -> Reply | None:
        if self.leaving and incoming.header["kind"] == "ping":  # so a goodbye is believed
            self._checked_leaving.add(incoming.header["from"])
            h = self._reply_header(incoming, "nack")
            h["reason"] = "leaving"
            return h, []
        kind = handle_control(self.table, incoming, self.keys is not None,
                              self.membership.check_soon)  # fmt: skip
        if kind is None:
            return None
        h = self._reply_header(incoming, kind)
        if kind == "pong":
            h["peers"] = self.table.listing()
            h["links"] = self.table.links()
            # did our own pings get through to it? Once is enough: a busy moment later
            # (pings lost under load) must not tell a reachable peer it is a client
            pinger = self.table.get(incoming.header["from"])
            if pinger is not None and pinger.reached is not None:
                h["reach"] = True
            elif pinger is not None and pinger.reachable is False:
                h["reach"] = False
        return h, []

    def _heavy(self, incoming: Incoming) -> Reply | None:
        if incoming.header["kind"] == "xreq":
            reply = self.averager.serve_exchange(incoming)
        else:
            reply = self.averager.serve_state(incoming)
        # only once its tensors passed every check; its address stays a claim until our
        # own ping proves it (heartbeat.py), keyed or not
        h = incoming.header
        self.table.heard(h, source=h["from"] if self.keys is not None else incoming.address)
        return reply

    def _seed_owner(self, endpoint: str) -> str | None:
        """Keyed: the member found listening at a seed (or named for it), else None."""
        watch = self._seeds
        return watch.owner(endpoint) if watch is not None else self.cfg.seed_names.get(endpoint)

    def _on_reply_reject(self, err: Rejected, address: str) -> None:
        """A reply to our own request failed its check: a member of another group, model or
        protocol answered (join() ends on it at once)."""
        if err.reason in MISMATCHES and self.join_refusal is None:
            self.join_refusal = (address, err)
        self._on_reject(err, address)

    def _on_reject(self, err: Rejected, address: str) -> None:
        self.counters.inc(f"rejected.{err.reason}")
        who = err.sender or "unknown sender"
        self.limiter.warning(
            f"reject:{err.reason}:{who}",
            "rejected a message from %s at %s: %s; not choosing it for %.0fs",
            who,
            address or "unknown address",
            err,
            self.cfg.penalty_s,
        )
        if err.sender and err.sender != self.id:
            self.table.penalise(err.sender)

    def _on_denied(self, key: str, address: str) -> None:
        self.counters.inc("auth.denied")
        self.limiter.warning(  # a line per address: each is someone to tell (or to block)
            f"denied:{address}",
            "refused %s: its key %s... is not in this group's allow-list (a new member: "
            "`atom keygen DIR --peers NAME` adds it, and members re-read allowed/)",
            address or "a client", key[:8],
        )  # fmt: skip

    # ------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Authenticator and server up; returns the endpoint other peers dial ("" for a
        client: no --listen, nothing to dial; it starts every exchange itself)."""
        if self.cfg.listen is None:
            self.reach.mode = "client"
            self.log.info(
                "no --listen: joining as a client (group %s, %s, %s codec): you exchange "
                "with reachable members, they cannot start exchanges with you; add --listen "
                "tcp://0.0.0.0:PORT (and a forwarded port if others cannot reach you) to be "
                "a full member", self.group, self.cfg.strategy, self.cfg.codec,
            )  # fmt: skip
            self.write_status()
            return self.endpoint
        if self.keys is not None:
            self.auth = start_authenticator(self.ctx, self.keys, self._on_denied)
        self.server = Server(
            self.ctx,
            self.cfg.listen,
            self.expect,
            self.keys,
            self.max_bytes,
            inline=self._inline,
            heavy=self._heavy,
            heavy_kinds={"xreq", "sreq"},
            make_header=self._reply_header,
            on_reject=self._on_reject,
            shaper=self.shaper,
            counters=self.counters,
            plog=self.log,
            max_requests_per_s=self.cfg.max_requests_per_s,
            me=self.id,
            # honest messages in flight (libzmq holds each whole until it is delivered)
            # and their decoded copies must not trip it: at least 8 of the largest
            recv_guard_bytes=(
                max(int(self.cfg.recv_guard_mb * 2**20), 8 * self.max_bytes)
                if self.cfg.recv_guard_mb > 0
                else 0
            ),
        )
        bound = self.server.start()
        self.endpoint = self.reach.endpoint = self.cfg.advertise or advertised(bound)
        if self.keys is None and not is_loopback(bound):
            self.log.warning(
                "listening on %s WITHOUT a group key (--insecure): anyone who can reach this "
                "port can join and send weights", bound
            )  # fmt: skip
        self.log.info(
            "listening on %s (group %s, %s, %s selection, %s codec)",
            self.endpoint, self.group, self.cfg.strategy, self.cfg.selection, self.cfg.codec,
        )  # fmt: skip
        self.write_status()
        return self.endpoint

    def join(self) -> None:
        """Find the group through the seeds, copy its parameters and step, start mixing."""
        self.membership.start()
        if self.cfg.seeds:
            self._reach_a_member()
            if self.cfg.pull_state:
                step, samples, source = self.averager.pull_state(
                    self._ready_sources, self.cfg.join_timeout_s
                )
                self.step = self.base_step = self.merge.step = step
                self.base_samples, self.joined_from = samples, source
                self.merge.reset()
                for unit, parts in self.averager.pulled_parts.items():
                    self.merge.adopt(unit, parts)  # e.g. the group's outer optimizer
                self.averager.pulled_parts.clear()
                self.log.info("joined: copied parameters at step %d from %s", step, source)
        self.averager.ready.set()
        self.averager.start()
        self._wait_for_peers()
        self.write_status()

    def _reach_a_member(self) -> None:
        """Wait until a seed's member answers; a refusal (another model, no or another
        key) ends the wait at once with the reason, not at the join timeout."""
        deadline = time.monotonic() + self.cfg.join_timeout_s
        watch = self._seeds = SeedWatch(self.ctx, self.keys, self.cfg.seeds, self.cfg.seed_names)
        probe_at = time.monotonic() + 3  # once: is anything listening at the seeds?
        try:
            while not self._ready_sources():
                if self.join_refusal is not None:
                    raise GossipError(_refusal_message(*self.join_refusal))
                refused = watch.refusal()
                if refused:
                    raise GossipError(f"{refused}; this peer cannot join")
                if time.monotonic() > deadline:  # refused: a wrong port, not a NAT
                    refused = refused_everywhere(self.cfg.seeds)
                    raise GossipError(no_member_line(self.cfg.seeds, self.cfg.join_timeout_s,
                                                     refused))  # fmt: skip
                if time.monotonic() > probe_at:  # one probe: each is a connection to them
                    probe_at = float("inf")
                    if refused_everywhere(self.cfg.seeds):
                        self.log.warning("nothing accepts connections at %s yet (refused): "
                                         "waiting up to %.0fs for the member to start",
                                         ", ".join(self.cfg.seeds),
                                         self.cfg.join_timeout_s)  # fmt: skip
                self.stop.wait(0.1)
        finally:
            watch.close()

    def _wait_for_peers(self) -> None:
        """gossip.wait_peers: start together (a group of friends, a fair experiment)."""
        want = self.cfg.wait_peers
        deadline = time.monotonic() + self.cfg.join_timeout_s

        def ready() -> int:  # clients count: they train with the group
            return sum(p.ready for p in self.table.alive())

        while ready() < want and time.monotonic() < deadline:
            self.stop.wait(0.1)
        have = ready()
        if have < want:
            self.log.warning("only %d of %d peers arrived in time; training anyway", have, want)

    def _ready_sources(self) -> list[PeerState]:
        """Ready members we can dial (a client holds the weights too, but nobody can ask)."""
        ready = [p for p in self.table.alive() if p.ready and p.reachable is True]
        return sorted(ready, key=lambda p: p.rtt if p.rtt is not None else 1e9)

    def listener_closed(self) -> contextlib.AbstractContextManager:
        """No gossip connections (nor their file descriptors) while the block runs: for a
        checkpoint save that ran out of open files (transport.Server.listener_closed)."""
        if self.server is None or self.closed:  # nothing listens (closed: goodbye said)
            return contextlib.nullcontext()
        return self.server.listener_closed()

    def checkpoint(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
        """Gossip's own state for a checkpoint, read once: its files (DiLoCo's outer
        weights and momentum; none for plain averaging) and its meta."""
        tensors, meta = self.merge.state()
        files = [("gossip_outer", tensors)] if tensors else []
        return files, {"gossip": {"strategy": self.merge.name, **meta}}

    def load_state(self, get, names: set[str], meta: dict[str, Any]) -> bool:
        """Resume the merge's state from a checkpoint (this peer's own run, not a pull from
        the group), after the weights; False if it holds none: the state then starts from
        the weights as they are now."""
        self.merge.reset()
        saved = meta.get("gossip") if isinstance(meta, dict) else None
        if not isinstance(saved, dict) or saved.get("strategy") != self.merge.name:
            return False
        wanted = [n for n in names if n.startswith("optim.outer.")]
        return self.merge.load({n: get(n) for n in wanted}, saved)

    def distrust_since(self, since: float) -> list[str]:
        """The run rolled back to a checkpoint written at `since` (monotonic): every peer
        merged with after it is penalised (neither chosen nor served for
        gossip.penalty_s); the penalised ids. (The merge's own state comes back with the
        weights: load_state.)"""
        with self.table.lock:
            ids = [p.id for p in self.table.peers.values()
                   if p.last_exchange is not None and p.last_exchange > since]  # fmt: skip
        for pid in ids:
            self.table.penalise(pid)
        return sorted(ids)

    def after_step(self, step: int) -> None:
        """Called by the trainer after each optimizer step: no locks, no waiting."""
        self.step = step
        self.merge.step = step

    def take_alarm(self) -> str | None:
        """Once: a unit gossip collapsed or blew up lately (atom/gossip/budget.py); the
        trainer rolls back on it (atom/run/guard.py gossip_alarm)."""
        return self.averager.budget.take_alarm()

    def close(self, goodbye: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self.leaving = goodbye  # a crash (goodbye=False) says nothing
        self.stop.set()
        self.averager.join()
        self.membership.join()
        self.averager.close_clients()
        self._heartbeat_client.close()
        said: set[str] = set()
        if goodbye:
            # a client of its own: the others were told to stop waiting
            bye = self._client(threading.Event())
            try:
                said = self.membership.goodbye(bye)
            except Exception:
                self.log.exception("goodbye failed")
            finally:
                bye.close()
            # an open group checks a goodbye with a ping: answer it (a client cannot)
            if self.keys is None and self.server is not None:
                deadline = time.monotonic() + LINGER_S
                while not said <= self._checked_leaving and time.monotonic() < deadline:
                    time.sleep(0.01)
        if self.server is not None:
            self.server.close()
        if self.auth is not None:
            self.auth.stop()
        self.write_status(state="stopped")
        self.ctx.destroy(linger=0)
        if goodbye:  # a failed join (or a crash) left no group: nothing to say
            self.log.info("left the group (%d peers acknowledged goodbye)", len(said))

    # ------------------------------------------------------------ reporting
    def status(self, state: str = "running") -> dict[str, Any]:
        return {
            "id": self.id,
            "endpoint": self.endpoint,
            "group": self.group,
            "state": state,
            "mode": self.reach.mode,
            "ready": self.averager.ready.is_set(),
            "step": self.step,
            "samples": self.samples,
            "joined_from": self.joined_from,
            "strategy": self.cfg.strategy,
            "selection": self.cfg.selection,
            "codec": self.cfg.codec,
            "time": time.time(),
            "wire": self.wire(),
            "counters": self.counters.snapshot(),
            "peers": self.table.rows(),
        }

    def write_status(self, state: str = "running") -> None:
        """Every heartbeat: gossip.json for `atom peers`, and a log line now and then."""
        now = time.monotonic()
        if state == "running" and now - self._last_summary >= SUMMARY_EVERY_S:
            self._last_summary = now
            self.log.info("%s", self.summary())
        if self.run_dir is None:
            return
        with self._status_lock:
            try:
                write_status(self.run_dir, self.status(state))
            except OSError as err:
                self.log.debug("cannot write status: %s", err)

    def summary(self) -> str:
        alive = sorted(self.table.alive(), key=lambda p: p.id)
        c = self.counters.snapshot()
        links = ", ".join(
            f"{p.id} {p.bw * 8 / 1e6:.0f} Mb/s" if p.bw else f"{p.id} (unmeasured)" for p in alive
        )
        rejected = int(sum(v for k, v in c.items() if k.startswith("rejected.")))
        return (
            f"step {self.step}: {len(alive)} peer(s) [{links or 'none'}]; exchanges "
            f"{int(c.get('exchange.ok', 0))} made, {int(c.get('served.ok', 0))} served, "
            f"{int(c.get('exchange.failed', 0))} failed; {rejected} message(s) rejected"
        )

    def wire(self) -> dict[str, Any]:
        """Bytes on the wire per optimizer step trained here (everything this peer sent
        and received: exchanges both ways, state, heartbeats), against the fp32 model's
        size: what one plain fp32 average of the whole model would move."""
        steps = max(0, self.step - self.base_step)
        sent, received = self.counters.get("sent.bytes"), self.counters.get("recv.bytes")
        return {
            "steps": steps,
            "sent_per_step": sent / steps if steps else None,
            "received_per_step": received / steps if steps else None,
            "model_fp32_bytes": 4 * self.params.total_numel(),
        }

    def record(self) -> dict[str, Any]:
        """A few numbers for metrics.jsonl."""
        return {
            "sent_bytes": int(self.counters.get("sent.bytes")),
            "peers": len(self.table.alive()),
            "exchanges": int(self.counters.get("exchange.ok") + self.counters.get("served.ok")),
            "rejected": int(
                sum(v for k, v in self.counters.snapshot().items() if k.startswith("rejected."))
            ),
        }

    def postfix(self) -> dict[str, Any]:
        return {"peers": len(self.table.alive())}


def attach_gossip(
    cfg: Config, shared: list[SharedUnit], run_dir: Path, start_step: int
) -> GossipPeer:
    """Start gossip for a Trainer over the engine's shared units: listen, join and pull
    state before the first step."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    samples_per_step = cfg.train.micro_batch * cfg.train.grad_accum
    peer = GossipPeer(cfg.gossip, UnitParams(shared), run_dir, start_step, samples_per_step)
    try:
        peer.start()
        peer.join()
    except BaseException:
        peer.close(goodbye=False)
        raise
    return peer
