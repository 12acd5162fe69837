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
        self._unheard: dict[str, float] = {}  # endpoint -> when its socket opened, until a reply
        # one source for all of a peer's clients: servers refuse a (sender, rid) seen before
        self._rid = rids if rids is not None else RequestIds()

    def next_rid(self) -> int:
        return next(self._rid)

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0  # close() drops whatever a dead peer never took
            sock.sndtimeo = 0
            sock.sndhwm = 16
            sock.rcvhwm = 16
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_bytes)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            secure_client(sock, self.keys)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
            self._unheard[endpoint] = time.monotonic()
        return sock

    def drop(self, endpoint: str) -> None:
        self._unheard.pop(endpoint, None)
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, endpoint: str, dest: tuple[str, ...], header: dict, buffers: list) -> bool:
        """Shape, then queue one message; False if it could not be queued or we stopped."""
        data = pack(header)
        if not self.shaper.wait(dest, len(data) + frames_nbytes(buffers), self.stop):
            return False
        try:
            self._socket(endpoint).send_multipart([data, *buffers], copy=False)
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
        self, items: list[tuple[str, tuple[str, ...], dict, list]], timeout: float
    ) -> dict[str, Incoming | None]:
        """Send one request to each endpoint, then collect replies until the deadline."""
        deadline = time.monotonic() + timeout
        waiting = {}
        for endpoint, dest, header, buffers in items:
            if self.send(endpoint, dest, header, buffers):
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
            socks = {self._socket(ep): ep for ep in pending}
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            for sock, _ in poller.poll(min(left, POLL_MS / 1000) * 1000):
                ep = socks[sock]
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                self._unheard.pop(ep, None)  # connected: its handshakes are done
                reply = self._check(parts, pending[ep])
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

    def _check(self, parts: list, rid: int) -> Incoming | None | bool:
        nbytes, address = received(parts, self.counters)
        try:
            header = read_header(parts, nbytes, self.max_bytes, self.expect)
            if header["rid"] != rid:
                return False
            if header["to"] != self.me:  # not an answer to us (a reflected or forged reply)
                raise Rejected("misdirected", f"a reply for {header['to']!r}")
            check_frames(header, parts[1:])
        except Rejected as err:
            self.on_reject(err, address)
            return None
        return Incoming(header, parts[1:], nbytes, address)

    def close(self) -> None:
        for ep in list(self._socks):
            self.drop(ep)
