"""ZeroMQ transport, the client side: request/reply over DEALER sockets.

A DEALER per destination, created lazily, with LINGER 0; a request waits for its reply
(matched by rid, and addressed to us) with a poll timeout, and on timeout the socket is
closed, which drops anything still queued for a dead peer; except a socket that has not
heard anything yet while it is younger than CONNECT_GRACE_S: its connection may still be
in its handshakes (TCP, ZMTP, CURVE: about five round trips, over a second on a 200 ms
link, longer than a heartbeat's ping waits), and closing it would start them all over at
every ping, so that a far peer could never be reached. Nothing here blocks without a
timeout. One instance per thread (zmq sockets are not thread-safe); a peer's clients
share one source of request ids (servers refuse a rid seen before: replay.py).

In a keyed group a request goes to the member its header names (`to`), with that name's
public key as the server key (keys.py): only that member can complete the handshake, a
name with no key in allowed/ is never dialled, and a reply whose `from` is another name
is refused. A socket the caller marks `once` (an endpoint that has never answered us:
someone else's word, membership.py) makes one connection attempt and never reconnects,
so a dead or foreign endpoint costs one connection per dial, not libzmq's redials.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import zmq

from atom.gossip.net.counters import Counters
from atom.gossip.net.keys import GroupKeys, secure_client
from atom.gossip.net.replay import RequestIds
from atom.gossip.net.shaping import LinkShaper
from atom.gossip.net.transport import POLL_MS, Incoming, frames_nbytes, read_header, received
from atom.gossip.net.wire import Expect, Rejected, check_frames, pack

CONNECT_GRACE_S = 4.0  # a new socket's handshakes may take this long before a timeout drops it


class Client:
    """Request/reply over DEALER sockets; one instance per thread (sockets are not
    thread-safe). Every wait is bounded; a timed-out socket is closed and rebuilt."""

    def __init__(
        self,
        ctx: zmq.Context,
        keys: GroupKeys | None,
        expect: Expect,
        max_bytes: int,
        shaper: LinkShaper,
        counters: Counters,
        on_reject: Callable[[Rejected, str], None],
        stop: threading.Event,
        me: str = "",
        rids: Iterator[int] | None = None,
    ):
        self.ctx, self.keys, self.expect, self.max_bytes = ctx, keys, expect, max_bytes
        self.shaper, self.counters, self.on_reject, self.stop = shaper, counters, on_reject, stop
        self.me = me
        self._socks: dict[str, zmq.Socket] = {}
        self._names: dict[str, str] = {}  # endpoint -> the name its socket was dialled as
        self._unheard: dict[str, float] = {}  # endpoint -> when its socket opened, until a reply
        # one source for all of a peer's clients: servers refuse a (sender, rid) seen before
        self._rid = rids if rids is not None else RequestIds()

    def next_rid(self) -> int:
        return next(self._rid)

    def _socket(self, endpoint: str, name: str, once: bool = False) -> zmq.Socket | None:
        """The socket to `endpoint` dialled as `name`; None if a keyed group has no key
        for that name (it is not dialled at all)."""
        sock = self._socks.get(endpoint)
        if sock is not None and self.keys is not None and self._names.get(endpoint) != name:
            self.drop(endpoint)  # another member now said to be there: its own key
            sock = None
        if sock is None:
            server_key = self.keys.key_of(name) if self.keys is not None else None
            if self.keys is not None and server_key is None:
                self.counters.inc("sent.unkeyed")
                return None
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0  # close() drops whatever a dead peer never took
            sock.sndtimeo = 0
            sock.sndhwm = 16
            sock.rcvhwm = 16
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_bytes)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            if once:  # one connection attempt: never redialled (libzmq: -1, no reconnect)
                sock.setsockopt(zmq.RECONNECT_IVL, -1)
            secure_client(sock, self.keys, server_key)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
            self._names[endpoint] = name
            self._unheard[endpoint] = time.monotonic()
        return sock

    def holds(self, endpoint: str, name: str) -> bool:
        """A socket to `endpoint`, dialled as `name` (keyed groups), is open (connected,
        or still in its handshakes): a request to it opens no new connection."""
        return endpoint in self._socks and (self.keys is None or self._names[endpoint] == name)

    def drop(self, endpoint: str) -> None:
        self._unheard.pop(endpoint, None)
        self._names.pop(endpoint, None)
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def send(
        self, endpoint: str, dest: tuple[str, ...], header: dict, buffers: list, once: bool = False
    ) -> bool:
        """Shape, then queue one message to the member `header["to"]` names; False if it
        could not be queued, has no key to be dialled with, or we stopped."""
        data = pack(header)
        if not self.shaper.wait(dest, len(data) + frames_nbytes(buffers), self.stop):
            return False
        sock = self._socket(endpoint, header["to"], once)
        if sock is None:
            return False
        try:
            sock.send_multipart([data, *buffers], copy=False)
        except zmq.ZMQError:  # EAGAIN: HWM full, the peer is not taking messages
            self.drop(endpoint)
            return False
        self.counters.inc("sent.msgs")
        self.counters.inc("sent.bytes", len(data) + frames_nbytes(buffers))
        return True

    def request(
        self,
        endpoint: str,
        dest: tuple[str, ...],
        header: dict,
        buffers: list,
        timeout: float,
        abort: Callable[[], bool] | None = None,
    ) -> Incoming | None:
        """Send and wait for the reply with the same rid; None on timeout, on a bad reply,
        or as soon as abort() says the wait is pointless (the peer was declared dead)."""
        deadline = time.monotonic() + timeout
        if not self.send(endpoint, dest, header, buffers):
            return None
        return self._await({endpoint: header["rid"]}, deadline, abort).get(endpoint)

    def request_many(
        self,
        items: list[tuple[str, tuple[str, ...], dict, list]],
        timeout: float,
        once: set[str] | frozenset[str] = frozenset(),
    ) -> dict[str, Incoming | None]:
        """Send one request to each endpoint, then collect replies until the deadline.
        Endpoints in `once` get (if new) a socket that dials once and never again."""
        deadline = time.monotonic() + timeout
        waiting = {}
        for endpoint, dest, header, buffers in items:
            if self.send(endpoint, dest, header, buffers, once=endpoint in once):
                waiting[endpoint] = header["rid"]
        replies = self._await(waiting, deadline)
        return {item[0]: replies.get(item[0]) for item in items}

    def _await(
        self, waiting: dict[str, int], deadline: float, abort: Callable[[], bool] | None = None
    ) -> dict[str, Incoming | None]:
        out: dict[str, Incoming | None] = {}
        pending = dict(waiting)
        while pending and not self.stop.is_set() and not (abort and abort()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            poller = zmq.Poller()
            socks = {self._socks[ep]: ep for ep in pending if ep in self._socks}
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            for sock, _ in poller.poll(min(left, POLL_MS / 1000) * 1000):
                ep = socks[sock]
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                self._unheard.pop(ep, None)  # connected: its handshakes are done
                reply = self._check(parts, pending[ep], self._names.get(ep, ""))
                if reply is False:
                    continue  # a stale reply to an earlier, timed-out request
                if reply is not None:
                    reply.dialled = ep
                out[ep] = reply
                del pending[ep]
        now = time.monotonic()
        for ep in pending:  # no reply in time: forget the socket and what it queued
            if now - self._unheard.get(ep, -1e9) >= CONNECT_GRACE_S:
                self.drop(ep)
            out[ep] = None
        return out

    def _check(self, parts: list, rid: int, name: str) -> Incoming | None | bool:
        nbytes, address = received(parts, self.counters)
        try:
            header = read_header(parts, nbytes, self.max_bytes, self.expect)
            if header["rid"] != rid:
                return False
            if header["to"] != self.me:  # not an answer to us (a reflected or forged reply)
                raise Rejected("misdirected", f"a reply for {header['to']!r}")
            if self.keys is not None and header["from"] != name:  # the key was name's
                raise Rejected("identity", f"{name}'s key answered as {header['from']!r}")
            check_frames(header, parts[1:])
        except Rejected as err:
            self.on_reject(err, address)
            return None
        return Incoming(header, parts[1:], nbytes, address)

    def close(self) -> None:
        for ep in list(self._socks):
            self.drop(ep)
