"""A half-open connection flood against a gossip peer: TCP connections that never send a
byte of the ZeroMQ greeting, each opened again as soon as it is dropped (the flooder of
tools/bench/flood.py, a child process, from loopback addresses the honest peers do not
use). The peer's open files stay bounded, no such connection outlives the handshake
timeout by much, and exchanges with an honest partner go on.

    pytest tests/test_gossip_flood.py
"""

from __future__ import annotations

import socket
import time

import pytest

from atom.gossip.net.counters import Counters
from atom.gossip.net.gate import HANDSHAKE_S, PER_ADDRESS, TOTAL, ConnectionGate, address_key
from atom.gossip.net.keys import keygen
from atom.gossip.net.listener import BACKLOG, attach, open_listener, refusing
from atom.gossip.net.memguard import open_files
from tests.adversary import Adversary
from tests.test_gossip_peers import group, wait_until  # noqa: F401 (fixture)
from tools.bench.flood import flooding

# the peers' own sockets and files, and a burst: libzmq accepts what comes (the flood's
# first connections, the SYNs it sends again as a ban ends: hundreds in a few ms) before
# the gate next reads its monitor (every GATE_MS) and ends them
MARGIN = 64 + BACKLOG
SETTLE_S = 1.0  # the flood's start: its first burst ended


def _exchanges(peer) -> float:
    return peer.counters.get("served.ok") + peer.counters.get("exchange.ok")


def _flood(victim, partner, n: int, sources: list[str], seconds: float) -> tuple[int, dict, float]:
    """The most files the process held above its level before (once the first burst is
    over), the flooder's summary, and the exchanges of `victim` meanwhile."""
    before, done = open_files(), _exchanges(victim)
    most = 0
    with flooding(victim.endpoint, n, sources) as summary:
        start = time.monotonic()
        while time.monotonic() < start + seconds:
            if time.monotonic() > start + SETTLE_S:
                most = max(most, (open_files() or 0) - before)
            time.sleep(0.05)
        assert partner.table.get(victim.id).status == "alive"
        exchanged = _exchanges(victim) - done
    return most, summary, exchanged


def _pair(group, names=("a", "b"), keys=("", "")):  # noqa: F811
    a = group(names[0], seed=1, group_key=keys[0])
    b = group(names[1], seed=2, join=a.endpoint, group_key=keys[1])
    wait_until(lambda: a.table.get(b.id) is not None and a.table.get(b.id).status == "alive")
    wait_until(lambda: _exchanges(a) > 2, 10, "exchanges before the flood")
    return a, b


def test_a_half_open_flood_from_many_addresses_is_capped_in_all(group):  # noqa: F811
    """3,000 connections from 32 addresses (each over its own cap): the peer holds at most
    TOTAL unfinished ones (it held every one, 30 s each, and ~3,000 open files)."""
    a, b = _pair(group)
    sources = [f"127.0.1.{k}" for k in range(1, 33)]
    most, flood, exchanged = _flood(a, b, 3000, sources, HANDSHAKE_S + 3.0)
    assert flood["opened"] >= 3000, flood
    assert most <= TOTAL + MARGIN, (most, flood)
    # the ones under the caps are dropped at the handshake timeout
    assert flood["longest_s"] <= HANDSHAKE_S + 1.5, flood
    assert exchanged >= 5, exchanged
    assert a.counters.get("gate.dropped") > 0


def test_a_half_open_flood_from_one_address_is_capped_per_address(group, tmp_path):  # noqa: F811
    """A keyed group (CURVE), 1,000 connections from one address: at most PER_ADDRESS of
    them are held; the honest partner's exchanges go on."""
    bundles = keygen(tmp_path, ["alice", "bob"])
    a, b = _pair(group, (None, None), tuple(str(x) for x in bundles))
    most, flood, exchanged = _flood(a, b, 1000, ["127.0.0.2"], 3.0)
    assert flood["opened"] >= 1000, flood
    assert most <= PER_ADDRESS + MARGIN, (most, flood)
    assert exchanged >= 5, exchanged


def test_a_burst_of_honest_connections_from_one_address_is_answered(group):  # noqa: F811
    """48 clients on 127.0.0.1 at once (a loopback group reconnecting) each send a ping:
    all are answered; none is ended, and the address is not refused."""
    a = group("a", seed=1)
    clients = [Adversary(a.endpoint, a.group, a.params.fingerprint, name=f"h{k}")
               for k in range(48)]  # fmt: skip
    try:
        for c in clients:
            h = c.header("ping", to="a")
            h.update(peers=[], links=[])
            c.send_raw(c.frames(h))
        answered = sum(1 for c in clients if c.sock.poll(10_000))
    finally:
        for c in clients:
            c.close()
    assert answered == len(clients)
    assert (a.counters.get("gate.dropped"), a.counters.get("gate.banned")) == (0, 0)


class _Frame:
    def __init__(self, fd: int):
        self.fd = fd

    def get(self, _: object) -> int:
        return self.fd


def test_honest_connections_on_one_address_are_not_cut_off():
    """Many connections from 127.0.0.1 at once (a loopback test group reconnecting), each
    speaking after its handshake: none is ended; only those that stay silent count, and
    only until the handshake timeout."""
    clock = [0.0]
    gate = ConnectionGate(Counters(), lambda *a: None, clock=lambda: clock[0])
    listener = socket.create_server(("127.0.0.1", 0))
    conns = []
    try:
        for k in range(3 * PER_ADDRESS):
            client = socket.create_connection(listener.getsockname())
            server, _ = listener.accept()
            conns += [client, server]
            gate._add(server.fileno(), server.getpeername(), clock[0])
            if k >= PER_ADDRESS - 1:  # these speak at once: their handshake is done
                gate.spoke(_Frame(server.fileno()))
        assert gate.counters.get("gate.dropped") == 0
        assert len(gate.pending) == PER_ADDRESS - 1 and not gate.banned
        clock[0] += HANDSHAKE_S  # still open after the timeout: finished, not counted
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        conns += [client, server]
        gate._add(server.fileno(), server.getpeername(), clock[0])
        assert list(gate.pending) == [server.fileno()]
        assert gate.counters.get("gate.dropped") == 0
    finally:
        for sk in conns:
            sk.close()
        listener.close()


@pytest.mark.parametrize(
    ("host", "key"),
    [("10.0.0.7", "10.0.0.7"), ("::ffff:10.0.0.7", "10.0.0.7"),
     ("2001:db8:1:2:aa::1", "2001:db8:1:2::/64"), ("", "")],
)  # fmt: skip
def test_an_ipv6_host_counts_as_its_64(host, key):
    assert address_key(host) == key


def _connects(source: str, dest: tuple) -> bool:
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sk:
        sk.settimeout(0.3)  # a SYN the filter drops is sent again only after 1 s
        sk.bind((source, 0))
        try:
            sk.connect(dest)
            return True
        except OSError:
            return False


@pytest.mark.parametrize(
    ("host", "banned", "refused", "let_in"),
    [("127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.3"), ("::1", "::/64", "::1", None)],
)
def test_the_listener_refuses_a_banned_address_in_the_kernel(host, banned, refused, let_in):
    """The socket filter drops the first packets of connections from a banned address
    (an IPv6 one by its /64), and lets others in; lifted, it lets everyone in."""
    try:
        made = open_listener(f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0")
    except OSError:
        pytest.skip(f"cannot listen on {host} here")
    assert made is not None
    fd, endpoint = made
    dest = (host, int(endpoint.rsplit(":", 1)[1]))
    with socket.socket(fileno=fd):
        if not attach(fd, refusing([banned])):
            pytest.skip("no socket filters on this system")
        assert not _connects(refused, dest)
        if let_in is not None:
            assert _connects(let_in, dest)
        assert attach(fd, refusing([]))
        assert _connects(refused, dest)
        assert attach(fd, refusing([], closed=True))
        assert not _connects(refused, dest)
