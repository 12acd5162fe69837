"""ZeroMQ transport, the server side: one ROUTER per peer (the clients, DEALER sockets
owned by one thread each, are in client.py).

Server: an I/O thread owns the ROUTER (and nothing else touches it: zmq sockets are not
thread-safe). It validates every message (wire.parse_header, check_frames, size limit)
before anyone sees it, answers cheap kinds (ping, probe, bye) inline, and hands heavy
kinds (exchanges, state pulls) to a small worker pool, whose replies come back over an
inproc socket for the I/O thread to send. So a slow exchange never delays a heartbeat,
and a full pool answers `busy` instead of queueing without bound. Before a message is
handed on: the thread's message budget, the sender's rate (limits.py), its identity,
destination and rid (replay.py); around it all, the memory and open-file guard
(memguard.py) that recycles the listener, and the caps on connections that never finish
their handshake (gate.py: the ROUTER's handshake timeout, and a monitor of its
connections, read by the I/O thread before its messages).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from atom.gossip.net.counters import Counters, LogLimiter
from atom.gossip.net.gate import GATE_MS, HANDSHAKE_S, ConnectionGate
from atom.gossip.net.handshake import FAILED as HANDSHAKE_FAILED
from atom.gossip.net.handshake import hung_up, member_note
from atom.gossip.net.keys import GroupKeys, secure_server
from atom.gossip.net.limits import RateLimiter, RequestLimits
from atom.gossip.net.listener import open_listener
from atom.gossip.net.memguard import InboundMemoryGuard, files_settle
from atom.gossip.net.replay import ReplayWindow
from atom.gossip.net.shaping import LinkShaper
from atom.gossip.net.wire import (
    MAX_HEADER_BYTES,
    Expect,
    Rejected,
    check_frames,
    pack,
    parse_header,
)
from atom.ground.errors import ConfigError

log = logging.getLogger(__name__)

# (header, tensor buffers[, work to do once the reply has been handed to the I/O thread])
Reply = tuple[dict[str, Any], list[Any]] | tuple[dict[str, Any], list[Any], Callable[[], None]]
POLL_MS = 100  # the I/O loop notices `stop` within this
REQUESTS = {"ping", "probe", "bye", "xreq", "sreq"}
PAUSE_S = 0.05  # what a server is sent; the rest answer
_server_ids = itertools.count()


@dataclass
class Incoming:
    header: dict[str, Any]
    frames: list  # tensor frames (zmq.Frame), already checked against header["tensors"]
    nbytes: int
    address: str = ""  # the remote IP, from zmq's Peer-Address
    dialled: str = ""  # a reply: the endpoint our request went to (proof it answers there)
    received: float = field(default_factory=time.monotonic)


def frame_property(frame: Any, name: str) -> str:
    try:
        return frame.get(name) or ""
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""


def received(parts: list, counters: Counters) -> tuple[int, str]:
    """Count a message as it comes in (server and client alike): its size in bytes and
    the remote address (zmq's Peer-Address)."""
    nbytes = sum(len(f) for f in parts)
    counters.inc("recv.msgs")
    counters.inc("recv.bytes", nbytes)
    return nbytes, frame_property(parts[0], "Peer-Address") if parts else ""


def read_header(parts: list, nbytes: int, max_bytes: int, expect: Expect) -> dict[str, Any]:
    """Not empty, not over max_bytes, then the validated header; raises Rejected."""
    if not parts:
        raise Rejected("garbage", "empty message")
    if nbytes > max_bytes:
        raise Rejected("oversized", f"{nbytes} bytes > limit {max_bytes}")
    return parse_header(parts[0].buffer, expect)


def frames_nbytes(buffers: list[Any]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


class Server:
    def __init__(
        self,
        ctx: zmq.Context,
        bind: str,
        expect: Expect,
        keys: GroupKeys | None,
        max_bytes: int,
        inline: Callable[[Incoming], Reply | None],
        heavy: Callable[[Incoming], Reply | None],
        heavy_kinds: set[str],
        make_header: Callable[[Incoming, str], dict[str, Any]],
        on_reject: Callable[[Rejected, str], None],
        shaper: LinkShaper,
        counters: Counters,
        plog: logging.LoggerAdapter,
        workers: int = 2,
        max_requests_per_s: float = 0.0,
        me: str = "",
        recv_guard_bytes: int = 0,
    ):
        self.ctx, self.bind, self.expect, self.keys = ctx, bind, expect, keys
        self.me = me
        self.replays = ReplayWindow()
        self.memory = InboundMemoryGuard(recv_guard_bytes)
        self.limits = RequestLimits(max_requests_per_s)  # every request, per sender
        # all messages together: what this thread reads a second at most (bursts of 0.1 s)
        per_s = max(1000.0, 10 * max_requests_per_s)
        self.budget = RateLimiter(per_s, burst=per_s / 10)
        self.max_bytes = max_bytes
        self.inline, self.heavy, self.heavy_kinds = inline, heavy, heavy_kinds
        self.make_header = make_header  # a reply header to `incoming` of a given kind
        self.on_reject, self.shaper, self.counters, self.log = on_reject, shaper, counters, plog
        self.limiter = LogLimiter(plog)
        self.gate = ConnectionGate(counters, self.limiter.warning)  # unfinished handshakes
        self.stop = threading.Event()
        self.endpoint = ""
        self._listening: int | None = None  # the listening descriptor, when made here
        self._told: dict[str, float] = {}  # address -> when it was last told it mismatches
        self._inproc = f"inproc://atom-gossip-replies-{next(_server_ids)}-{id(self)}"
        self._jobs: queue.Queue = queue.Queue(maxsize=workers * 2)
        self._n_workers = workers
        self._hold, self._held = threading.Event(), threading.Event()  # listener_closed
        self._threads: list[threading.Thread] = []

    def _listen(self, endpoint: str, patience_s: float = 0.0) -> zmq.Socket:
        """A ROUTER bound to `endpoint`; retried for patience_s (a port just closed, or
        no file descriptor free yet while the old connections close)."""
        deadline = time.monotonic() + patience_s
        while True:
            router = listening = None
            try:
                router = self.ctx.socket(zmq.ROUTER)
                router.linger = 0
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise
                router.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_bytes)  # memory guard per frame
                router.setsockopt(zmq.HANDSHAKE_IVL, int(1000 * HANDSHAKE_S))  # gate.py
                router.rcvhwm = router.sndhwm = 64
                secure_server(router, self.keys)
                listening = open_listener(endpoint)  # one the gate can filter: listener.py
                if listening is not None:
                    router.setsockopt(zmq.USE_FD, listening[0])
                router.bind(endpoint if listening is None else listening[1])
                self._listening = None if listening is None else listening[0]
                return router
            except (zmq.ZMQError, OSError) as err:
                if router is not None:
                    router.close(linger=0)
                if listening is not None:  # (libzmq takes it only once bound)
                    os.close(listening[0])
                if time.monotonic() < deadline and not self.stop.is_set():
                    time.sleep(0.05)
                    continue
                raise ConfigError(f"cannot listen on {endpoint}: {err}") from None

    def start(self) -> str:
        """Bind (port 0 picks a free port) and start the threads; returns the bound endpoint."""
        router = self._listen(self.bind)
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        pull = self.ctx.socket(zmq.PULL)
        pull.linger = 0
        pull.bind(self._inproc)
        io = threading.Thread(
            target=self._io, args=(router, pull), name="atom-gossip-io", daemon=True
        )
        self._threads = [io] + [
            threading.Thread(target=self._worker, name=f"atom-gossip-serve-{i}", daemon=True)
            for i in range(self._n_workers)
        ]
        for t in self._threads:
            t.start()
        return self.endpoint

    @contextlib.contextmanager
    def listener_closed(self, timeout_s: float = 5.0) -> Iterator[None]:
        """No listener (so no connection, and no file descriptor for one) until the block
        ends: a checkpoint save that ran out of open files gets them, even while a flood
        of connections comes straight back after every recycle. Peers reconnect after."""
        self._hold.set()
        try:
            if not self.stop.is_set() and self._held.wait(timeout_s):
                files_settle(timeout_s)
            yield
        finally:
            self._hold.clear()

    # ------------------------------------------------------------ I/O thread
    def _io(self, router: zmq.Socket, pull: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        monitor = self._watch(router, poller)
        poll_ms = min(POLL_MS, 1000 * self.memory.every_s) if self.memory.enabled else POLL_MS
        paused_until = 0.0  # over the message budget: the router is not read until then
        try:
            while not self.stop.is_set():
                if self._hold.is_set() == (router is not None):
                    if router is None:  # the hold is over: listen again
                        router = self._listen(self.endpoint, patience_s=30.0)
                        monitor = self._watch(router, poller)
                        self._held.clear()
                    else:  # a checkpoint save needs the files the connections hold
                        if paused_until:
                            poller.register(router, zmq.POLLIN)
                            paused_until = 0.0
                        self._unwatch(router, monitor, poller)
                        router = monitor = None
                        self.counters.inc("server.held")
                        self._held.set()
                grown, files = (0, 0) if router is None else (self.memory.over(),
                                                             self.memory.files_over())  # fmt: skip
                if grown or files:
                    if paused_until:
                        poller.register(router, zmq.POLLIN)
                        paused_until = 0.0
                    self._unwatch(router, monitor, poller)
                    router = monitor = None
                    router = self._recycle(grown, files)
                    monitor = self._watch(router, poller)
                wait_ms = poll_ms
                if paused_until:
                    left = paused_until - time.monotonic()
                    if left <= 0:
                        poller.register(router, zmq.POLLIN)
                        paused_until = 0.0
                    else:
                        wait_ms = min(poll_ms, 1000 * left)
                if monitor is not None:  # read every GATE_MS, not at each event (a flood
                    wait_ms = min(wait_ms, GATE_MS)  # churns thousands a second)
                events = dict(poller.poll(wait_ms))
                if monitor is not None:  # before the messages: a connection's first
                    # message then finds it in the gate's table
                    for event in self.gate.drain(monitor):
                        if hung_up(event):
                            continue
                        self.counters.inc("auth.handshake_failed")
                        note = member_note(event)
                        if note:
                            self.limiter.warning(f"handshake:{event['value']}", note)
                if pull in events:
                    for _ in range(64):
                        try:
                            out = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if router is None:  # held closed: the asker reconnects anyway
                            self.counters.inc("sent.dropped")
                        else:
                            self._send(router, out)
                if router is not None and router in events:
                    for _ in range(64):
                        if not self.budget.allow("all"):
                            # a flood: stop reading for a moment. libzmq queues per
                            # connection and fair-queues between them, so the flooder's
                            # queue fills (and TCP pushes back on it) while others get
                            # their turn; this thread sleeps instead of holding the GIL
                            # the training thread needs (a 10k/s flood made steps 6.5x
                            # slower)
                            self.counters.inc("server.paused")
                            poller.unregister(router)
                            paused_until = time.monotonic() + PAUSE_S
                            break
                        try:
                            msg = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            self._handle(router, msg)
                        except Exception:  # one message must never take the server down
                            self.counters.inc("server.errors")
                            self.log.exception("handling a message failed")
        except ConfigError as err:  # could not listen again after a recycle
            self.log.error("%s; this peer no longer serves gossip (training goes on)", err)
        except Exception:
            self.log.exception("gossip server I/O thread failed")
        finally:
            if router is not None:
                if paused_until:  # unregistered for the pause: _unwatch expects it polled
                    poller.register(router, zmq.POLLIN)
                self._unwatch(router, monitor, poller)
            pull.close(linger=0)

    def _watch(self, router: zmq.Socket, poller: zmq.Poller) -> zmq.Socket | None:
        """Poll the router; a monitor of its connections (the gate's, with the failed
        handshakes of a keyed group for their log lines), read every GATE_MS."""
        poller.register(router, zmq.POLLIN)
        monitor = None
        try:  # without it the handshake timeout and the open-file guard still hold
            monitor = self.gate.watch(router, HANDSHAKE_FAILED if self.keys else 0,
                                      self._listening)  # fmt: skip
        except zmq.ZMQError as err:  # EMFILE, during the very recycle that frees files
            self.log.warning(
                "no connection monitor (%s): connections that do not finish their "
                "handshake are not capped until the next recycle", err,
            )  # fmt: skip
        return monitor

    def _unwatch(self, router: zmq.Socket, monitor: zmq.Socket | None, poller: zmq.Poller):
        poller.unregister(router)
        if monitor is not None:
            self.gate.unwatch(router, monitor)
        router.close(linger=0)

    def _recycle(self, grown: int, files: int) -> zmq.Socket:
        """Memory grew past gossip.recv_guard_mb, or open files neared their limit: drop
        every connection (and the unfinished messages libzmq holds for them), check, and
        listen again (memguard.py)."""
        freed = self.memory.settle() if grown else 0
        if files:
            self.memory.files_recycled(files)
        self.counters.inc("guard.recycled")
        if files:
            self.counters.inc("guard.files")
            self.limiter.warning(
                "files", "dropped every gossip connection: %d files open, near the limit "
                "(ulimit -n); peers reconnect by themselves", files,
            )  # fmt: skip
        elif freed > grown // 2:
            self.counters.inc("guard.freed_mb", freed / 2**20)
            self.limiter.warning(
                "recycle",
                "dropped every gossip connection: %d MB held by unfinished incoming "
                "messages (over gossip.recv_guard_mb); peers reconnect by themselves",
                grown >> 20,
            )
        else:
            self.log.info("process memory grew %d MB (not gossip's); guard re-based", grown >> 20)
        return self._listen(self.endpoint, patience_s=30.0)

    def _send(self, router: zmq.Socket, frames: list) -> None:
        try:
            router.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.counters.inc("sent.msgs")
            self.counters.inc("sent.bytes", sum(len(f) for f in frames[1:]))
        except zmq.ZMQError as err:  # EHOSTUNREACH (gone: ROUTER_MANDATORY) or EAGAIN (HWM)
            self.counters.inc("sent.dropped")
            self.log.debug("reply dropped: %s", err)

    def _handle(self, router: zmq.Socket, msg: list) -> None:
        ident, parts = msg[0], msg[1:]
        if self.gate.pending and parts:  # any message: its connection finished its handshake
            self.gate.spoke(parts[0])
        nbytes, address = received(parts, self.counters)
        try:
            header = read_header(parts, nbytes, self.max_bytes, self.expect)
            check_frames(header, parts[1:])
            self._check_sender(header, parts[0])
        except Rejected as err:
            self._refused(router, ident, address, parts, err)
            return
        self.counters.inc(f"recv.{header['kind']}")
        if not self.limits.allow(address, header["from"]):  # every kind: a ping flood too
            self.counters.inc("rejected.rate")
            self.limiter.warning(f"rate:{address}", "dropping requests from %s at %s: "
                                 "over the per-sender rate limit (gossip."
                                 "max_requests_per_s)", header["from"], address)  # fmt: skip
            return
        # the rid last: a message refused for any reason above must not spend it (forged
        # in a peer's name, it would fill the window with rids the peer may use)
        if not self.replays.fresh(header["from"], header["inc"], header["rid"]):
            err = Rejected("replay", f"{header['kind']} {header['rid']} from "
                           f"{header['from']!r} was seen before")  # fmt: skip
            self._refused(router, ident, address, parts, err)
            return
        incoming = Incoming(header, parts[1:], nbytes, address)
        if header["kind"] in self.heavy_kinds:
            try:
                self._jobs.put_nowait((ident, incoming))
            except queue.Full:
                self._reply(router, ident, incoming, self.refusal(incoming, "busy", "overloaded"))
            return
        try:
            reply = self.inline(incoming)
        except Rejected as err:
            err.sender = err.sender or header["from"]
            self.on_reject(err, address)
            return
        if reply is not None:
            self._reply(router, ident, incoming, reply)

    def _refused(self, router: zmq.Socket, ident: Any, address: str, parts: list,
                 err: Rejected) -> None:  # fmt: skip
        if err.reason == "oversized" and err.sender is None and parts:
            err.sender = _sender_hint(parts[0])
        self.on_reject(err, address)
        if err.reason in MISMATCHES:
            self._tell_mismatch(router, ident, address)

    def _check_sender(self, header: dict[str, Any], first: Any) -> None:
        """Who may send this, and to whom. None of these failures (nor a replay) penalise
        the peer the message names: it is most likely not who sent it."""
        claimed, kind = header["from"], header["kind"]
        if kind not in REQUESTS:
            raise Rejected("schema", f"{kind} from {claimed!r} is a reply, not a request")
        if self.keys is not None:  # the channel's own name: ZAP User-Id, the key's file name
            user = frame_property(first, "User-Id")
            if claimed != user:
                raise Rejected("identity", f"sent as {claimed!r} over {user or 'another'}'s key")
        if header["to"] != self.me and not (kind == "ping" and header["to"] == ""):
            raise Rejected("misdirected", f"{kind} from {claimed!r} is for {header['to']!r}")

    def _tell_mismatch(self, router: zmq.Socket, ident: Any, address: str) -> None:
        """Answer a well-formed message from another group, model or protocol version with
        a `nack` in our own header: the sender's check of it fails on the same field, so a
        joiner learns at once why it is refused (it used to wait out its join timeout and
        be told to check its firewall). At most once a second per address, no tensors."""
        now = time.monotonic()
        if now - self._told.get(address, -1e9) < 1.0:
            return
        if len(self._told) > 1024:  # bounded: forget the oldest half
            for key in sorted(self._told, key=self._told.get)[:512]:
                del self._told[key]
        self._told[address] = now
        header = self.make_header(_NoRequest(), "nack")
        header["reason"] = "mismatch"
        try:
            router.send_multipart([ident, pack(header)], flags=zmq.NOBLOCK)
            self.counters.inc("sent.mismatch")
        except zmq.ZMQError:
            pass

    def refusal(self, incoming: Incoming, kind: str, reason: str) -> Reply:
        """A `busy` (try again later) or `nack` (will not serve this) reply."""
        header = self.make_header(incoming, kind)
        header["reason"] = reason
        if kind == "busy":
            header["unit"] = incoming.header.get("unit", 0)
        return header, []

    def _reply(self, router: zmq.Socket, ident: Any, incoming: Incoming, reply: Reply) -> None:
        header, buffers = reply
        data = pack(header)
        # control replies are tiny: charge the link but do not hold the I/O thread
        self.shaper.delay((incoming.header["from"], incoming.header["ep"]), len(data))
        self._send(router, [ident, data, *buffers])

    # ------------------------------------------------------------ workers
    def _worker(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.linger = 0
        push.sndtimeo = 1000  # the I/O thread gone (stopped): drop, never block for good
        push.connect(self._inproc)
        try:
            while not self.stop.is_set():
                try:
                    ident, incoming = self._jobs.get(timeout=POLL_MS / 1000)
                except queue.Empty:
                    continue
                try:
                    reply = self.heavy(incoming)
                except Rejected as err:
                    err.sender = err.sender or incoming.header["from"]
                    self.on_reject(err, incoming.address)
                    reply = self.refusal(incoming, "nack", f"rejected: {err.reason}")
                except Exception:
                    self.log.exception("serving %s failed", incoming.header["kind"])
                    reply = self.refusal(incoming, "nack", "internal error")
                if reply is None:
                    continue
                header, buffers = reply[0], reply[1]
                after = reply[2] if len(reply) > 2 else None
                try:
                    data = pack(header)
                    dest = (incoming.header["from"], incoming.header["ep"])
                    if not self.shaper.wait(dest, len(data) + frames_nbytes(buffers), self.stop):
                        break
                    try:
                        push.send_multipart([ident, data, *buffers], copy=False)
                    except zmq.Again:
                        self.counters.inc("sent.dropped")
                finally:
                    if after is not None:
                        after()
        finally:
            push.close(linger=0)

    def close(self, timeout: float = 5.0) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout)
        self.memory.close()


def _sender_hint(frame: Any) -> str | None:
    """Best-effort sender id of a message rejected before its header was validated."""
    try:
        import msgpack

        if len(frame) > MAX_HEADER_BYTES:
            return None
        raw = msgpack.unpackb(bytes(frame.buffer), raw=False, strict_map_key=True)
        return (
            raw.get("from") if isinstance(raw, dict) and isinstance(raw.get("from"), str) else None
        )
    except Exception:
        return None


class _NoRequest:
    """Stands in for a request that failed validation when a reply header is made for it."""

    header = {"rid": 0, "from": ""}


MISMATCHES = ("group", "fingerprint", "version")  # a peer of another run, not an attacker
