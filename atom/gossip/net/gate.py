"""Connections that never finish their handshake cost a bounded amount.

libzmq accepts every TCP connection made to a listener and keeps it (a file descriptor
and its buffers) until the remote end finishes the ZMTP greeting and handshake, for 30 s
by default: 3,000 connections that never sent a byte held a member at 3,037 open files
(issue 41). So:

- the server's ROUTER drops a connection whose handshake is not done within HANDSHAKE_S
  (zmq.HANDSHAKE_IVL; a CURVE handshake is about five round trips: over a second on a
  200 ms link, and a lost packet costs a second more);
- `ConnectionGate` keeps the table of unfinished connections, from a monitor on the
  ROUTER: accepted (EVENT_ACCEPTED gives the descriptor, getpeername the address), no
  message read from them (a message carries its connection's descriptor, zmq.SRCFD),
  younger than HANDSHAKE_S (one still open after that has finished: libzmq would have
  dropped it). Ends are not followed (EVENT_DISCONNECTED would double what a flood
  costs in events): a connection is checked when it is to be ended, and one gone by
  then only leaves the table (as it does when its descriptor is accepted again).
- at most PER_ADDRESS of them per remote address (an IPv6 address's /64: one host holds
  all of it) and TOTAL in all; beyond, the oldest of that address is ended (past TOTAL:
  of the address that holds the most). Honest peers are unfinished for a few round
  trips and then speak at once, so many peers on one address (a test group on
  127.0.0.1, a NAT) count only while they handshake.
- past a cap, the listener also refuses new connections in the kernel for BAN_S (by
  then the address's unfinished connections have finished or timed out): a socket
  filter (listener.py) drops their first packets. From that address past PER_ADDRESS;
  past TOTAL, from each address that holds an unfinished connection and finished none
  in the last KNOWN_S; from anyone for CLOSED_S when they are more than the filter
  lists (MAX_BANNED). Ending connections alone made a flood churn: a flooder opens a
  new one for each one ended, at once (8,000-14,000 a second on loopback: 0.4-1.1 of a
  core for libzmq and the I/O thread); refused, its connections wait out their SYN
  retries (1 s, 3 s, ...). Connections already open carry on; new ones from an honest
  peer behind the same address wait out the ban too.

Ending a connection that libzmq owns: the gate shuts the socket down through a duplicate
of its descriptor (shutdown acts on the connection; closing the duplicate leaves libzmq's
descriptor open), once it has checked that the duplicate is still that connection (the
remote address and port it had). libzmq then reads the end, says so, and closes its
descriptor as for any peer that hung up.

The monitor's queue has no bound (RCVHWM 0): libzmq's I/O thread, which every gossip
socket shares, waits when it is full, and it stalled there at ~2,000 unread events while
a flood was accepted (it also holds the monitor's lock then, which stopping the monitor
takes). Events are a few bytes each; the I/O thread reads them every GATE_MS, in batches
(at each event, a flood's thousands a second cost it more than the events themselves).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from atom.gossip.net.counters import Counters
from atom.gossip.net.listener import MAX_BANNED, attach, refusing

HANDSHAKE_S = 4.0  # the ROUTER drops a connection not through its handshake by then
# unfinished connections one remote address may hold at once: a loopback group's sockets
# reconnecting at once after a recycle (seven peers with four exchange lanes: ~40) fit
PER_ADDRESS = 64
TOTAL = 256  # unfinished connections in all
BAN_S = HANDSHAKE_S  # an address past PER_ADDRESS may not connect for this long
CLOSED_S = 1.0  # nobody may, past MAX_BANNED (an honest client's SYN comes again in 1 s)
KNOWN_S = 60.0  # an address that finished a handshake this lately is not refused past TOTAL
DRAIN = 4096  # monitor events read per call: the I/O thread has messages to read too
GATE_MS = 10  # the I/O thread reads the monitor this often (in batches: cheaper)
EVENTS = zmq.EVENT_ACCEPTED
_monitors = itertools.count()


def address_key(host: str) -> str:
    """What a remote address counts against: itself (an IPv4-mapped IPv6 address as its
    IPv4), or for IPv6 its /64."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return host


def through_dup(fd: int, act: Callable[[socket.socket], Any]) -> Any:
    """act(socket) on a duplicate of descriptor `fd` (closed after); None when `fd` is
    no socket any more or `act` fails (OSError)."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed, or no descriptor left for the duplicate
        return None
    try:
        sk = socket.socket(fileno=dup)
    except OSError:  # not a socket (the number went to a file)
        os.close(dup)
        return None
    with sk:
        try:
            return act(sk)
        except OSError:
            return None


@dataclass
class Unfinished:
    key: str  # address_key of the remote address
    peer: Any  # getpeername() when it was accepted: to know it again
    since: float


class ConnectionGate:
    """The unfinished connections of one listener, and their caps (module docstring).
    Used by the server's I/O thread only."""

    def __init__(
        self,
        counters: Counters,
        warn: Callable[..., None],
        per_address: int = PER_ADDRESS,
        total: int = TOTAL,
        handshake_s: float = HANDSHAKE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.counters, self.warn, self.clock = counters, warn, clock
        self.per_address, self.total, self.handshake_s = per_address, total, handshake_s
        self.pending: dict[int, Unfinished] = {}  # descriptor -> connection, oldest first
        self._by_key: dict[str, dict[int, None]] = {}  # address -> its descriptors, oldest first
        self.listener: int | None = None  # the listening descriptor, when it is ours
        self.banned: dict[str, float] = {}  # address -> refused until
        self.closed_until = 0.0  # every new connection refused until
        self._refusing: tuple = ((), False)  # what the listener's filter does now
        self.known: dict[str, float] = {}  # address -> when one of its connections finished

    # ------------------------------------------------------------ the monitor
    def watch(self, router: zmq.Socket, also: int = 0, listener: int | None = None) -> zmq.Socket:
        """Start monitoring `router` (for EVENTS and the events in `also`; `listener`: its
        listening descriptor, when listener.py made it); returns the socket to hand to
        drain(). Raises ZMQError (EMFILE in a recycle)."""
        self.clear()
        self.listener = listener
        addr = f"inproc://atom-gossip-gate-{next(_monitors)}-{id(self)}"
        router.monitor(addr, EVENTS | also)
        monitor = None
        try:
            monitor = router.context.socket(zmq.PAIR)
            monitor.rcvhwm = 0  # no bound: a full queue stalls libzmq's I/O thread
            monitor.linger = 0
            monitor.connect(addr)
            return monitor
        except zmq.ZMQError:
            if monitor is not None:
                monitor.close(linger=0)
            router.monitor(None, 0)
            raise

    def unwatch(self, router: zmq.Socket, monitor: zmq.Socket) -> None:
        router.monitor(None, 0)
        monitor.close(linger=0)
        self.clear()

    def clear(self) -> None:
        self.pending.clear()
        self._by_key.clear()
        self.listener = None
        self.banned.clear()
        self.closed_until = 0.0
        self._refusing = ((), False)

    def drain(self, monitor: zmq.Socket) -> list[dict]:
        """Read what the monitor has (at most DRAIN events), keep the table, end what is
        over a cap; returns the other events (handshake failures, for the log)."""
        other: list[dict] = []
        accepted: dict[int, None] = {}  # the last of each descriptor (numbers come back)
        for _ in range(DRAIN):
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_ACCEPTED:
                accepted.pop(event["value"], None)
                accepted[event["value"]] = None
            else:
                other.append(event)
        if accepted:
            now = self.clock()
            for fd in accepted:
                self._forget(fd)  # an earlier connection with that number is gone
                peer = through_dup(fd, lambda sk: sk.getpeername())
                if peer is not None:  # (None: it is gone already)
                    self._add(fd, peer, now)
        if self.banned or self.closed_until or accepted:
            self._refuse(self.clock())
        return other

    def spoke(self, frame: Any) -> None:
        """A message came in on `frame`'s connection: it has finished its handshake."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError, TypeError):
            return
        entry = self._forget(fd)
        if entry is not None and entry.key:
            self.known.pop(entry.key, None)
            self.known[entry.key] = entry.since
            if len(self.known) > 4 * self.total:  # bounded: the least recent goes
                del self.known[next(iter(self.known))]

    # ------------------------------------------------------------ the caps
    def _add(self, fd: int, peer: Any, now: float) -> None:
        host = peer[0] if isinstance(peer, tuple) else ""  # ipc: one local "address"
        key = address_key(host)
        self._expire(now)
        self.pending[fd] = Unfinished(key, peer, now)
        mine = self._by_key.setdefault(key, {})
        mine[fd] = None
        ended = False  # (not one that is gone already: ends are not followed)
        while len(mine) > self.per_address:
            ended |= self._end(next(iter(mine)), f"more than {self.per_address} from {key}")
        if ended:
            self._ban([key], now)
        ended = False
        while len(self.pending) > self.total:
            ended |= self._end(self._oldest_of_most(), f"more than {self.total} in all")
        if ended:  # every address that holds one, most of them the flood's
            self._ban([k for k in self._by_key if self.known.get(k, -KNOWN_S) < now - KNOWN_S],
                      now)  # fmt: skip

    def _ban(self, keys: list[str], now: float) -> None:
        for key in keys:
            if key and key not in self.banned:
                self.banned[key] = now + BAN_S
                self.counters.inc("gate.banned")
        if len(self.banned) > MAX_BANNED and self.closed_until <= now:  # too many to list
            self.closed_until = now + CLOSED_S
            self.counters.inc("gate.closed")

    def _refuse(self, now: float) -> None:
        """Bring the listener's filter up to date: bans over, bans new."""
        for key in [k for k, until in self.banned.items() if until <= now]:
            del self.banned[key]
        if self.closed_until <= now:
            self.closed_until = 0.0
        closed = bool(self.closed_until) or len(self.banned) > MAX_BANNED
        want = ((), True) if closed else (tuple(sorted(self.banned)), False)
        if want == self._refusing or self.listener is None:
            return
        self._refusing = want
        if attach(self.listener, refusing(*want)) and (want[0] or closed):
            who = "from anyone for a moment" if closed else "from " + ", ".join(want[0][:4])
            self.warn("gate:refuse", "refusing new connections %s%s: too many unfinished "
                      "handshakes (a flood?)", who, "..." if len(want[0]) > 4 else "")  # fmt: skip

    def _oldest_of_most(self) -> int:
        if len(self._by_key) == len(self.pending):  # one each: the oldest of all
            return next(iter(self.pending))
        most = max(self._by_key.values(), key=len)
        return next(iter(most))

    def _expire(self, now: float) -> None:
        """Connections older than the handshake timeout that are still open finished."""
        while self.pending:
            fd, oldest = next(iter(self.pending.items()))
            if now - oldest.since < self.handshake_s:
                return
            self._forget(fd)

    def _forget(self, fd: int) -> Unfinished | None:
        entry = self.pending.pop(fd, None)
        if entry is not None:
            mine = self._by_key[entry.key]
            del mine[fd]
            if not mine:
                del self._by_key[entry.key]
        return entry

    def _end(self, fd: int, why: str) -> bool:
        """End the connection at `fd`; False when it was gone already."""
        entry = self._forget(fd)
        assert entry is not None

        def shut(sk: socket.socket) -> bool:
            if sk.getpeername() != entry.peer:  # gone; the number went to another one
                return False
            sk.shutdown(socket.SHUT_RDWR)
            return True

        if not through_dup(fd, shut):
            return False
        self.counters.inc("gate.dropped")
        self.warn("gate", "dropping connections that do not finish their handshake: %s "
                  "(a flood?)", why)  # fmt: skip
        return True
