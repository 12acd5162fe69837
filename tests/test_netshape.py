"""tools/net/shape: namespaces come up shaped and connected, and always go away.

Tests that make namespaces are skipped with the reason `available()` gives (not root,
no `ip netns`, tc missing); the link-matrix checks run everywhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.net import shape as netshape
from tools.net.shape import NetShape, available, list_namespaces, measure_mbps, rate_matrix

REASON = available()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"cannot make namespaces: {REASON}")


def test_rate_matrix_uniform_and_explicit():
    m = rate_matrix(3, 20)
    assert m == [[0, 20, 20], [20, 0, 20], [20, 20, 0]]
    explicit = rate_matrix(2, [[5, 7], [9, 5]])
    assert explicit == [[0, 7], [9, 0]]  # the diagonal is not a link
    with pytest.raises(ValueError):
        rate_matrix(1, 10)
    with pytest.raises(ValueError):
        rate_matrix(2, [[0, 1, 2], [3, 0, 4]])
    with pytest.raises(ValueError):
        rate_matrix(2, -1)


def _ours(net: NetShape) -> set[str]:
    return set(net.nodes + [net.hub]) & set(list_namespaces())


@needs_netns
def test_setup_shapes_links_and_teardown_removes_everything():
    with NetShape(3, [[0, 8, 0], [8, 0, 0], [0, 0, 0]]) as net:
        assert _ours(net) == set(net.nodes + [net.hub])
        classes = net.qdisc_report(0)
        assert "rate 8Mbit" in classes  # 0 -> 1 shaped
        assert "1:12" not in classes  # 0 -> 2 left unshaped (default class)
        slow = measure_mbps(net, 0, 1, 1_000_000)
        fast = measure_mbps(net, 0, 2, 4_000_000)
        assert 5.5 < slow < 9.0, slow  # ~95% of the rate (TCP/IP headers), some burst
        assert fast > 50, fast
        p = net.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
    assert _ours(net) == set()
    assert p.poll() is not None  # stopped at teardown


@needs_netns
def test_teardown_on_exception_and_set_rates():
    net = NetShape(2, 0)
    with pytest.raises(RuntimeError, match="boom"), net:
        net.set_rates(10)
        assert "rate 10Mbit" in net.qdisc_report(1)
        raise RuntimeError("boom")
    assert _ours(net) == set()
    net.down()  # idempotent


CHILD = """
import sys, time
from tools.net.shape import NetShape
with NetShape(2, 50, tag=sys.argv[1]) as net:
    net.popen(0, [sys.executable, "-c", "import time; time.sleep(120)"])
    print(" ".join(net.nodes + [net.hub]), flush=True)
    time.sleep(60)
"""


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_teardown_on_signal(sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"sig{int(sig)}"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,  # so that `tools` imports
        # SIGINT as a terminal gives it, also when pytest runs as a background job
        # (which ignores SIGINT, and a child inherits that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        names = proc.stdout.readline().split()
        assert len(names) == 3 and set(names) <= set(list_namespaces())
        proc.send_signal(sig)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert not set(names) & set(list_namespaces())


@needs_netns
def test_cleanup_removes_namespaces_of_dead_processes():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"{netshape.PREFIX}-{dead.pid}-stale-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netshape.stale_namespaces()
        mine = f"{netshape.PREFIX}-{os.getpid()}-live-0"
        subprocess.run(["ip", "netns", "add", mine], check=True)
        try:
            assert mine not in netshape.stale_namespaces()  # our own process is alive
        finally:
            subprocess.run(["ip", "netns", "del", mine], check=False)
        assert name in netshape.cleanup()
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    deadline = time.monotonic() + 5
    while name in list_namespaces() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert name not in list_namespaces()


NAT_REASON = netshape.nat_available()
WIRE_REASON = netshape.wire_available()

ACCEPT_ONE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(8); s.settimeout(30); print("ready", flush=True)
while True:
    c, addr = s.accept(); print(addr[0], flush=True); c.close()
"""

CONNECT = """
import socket, sys, time
t = time.perf_counter()
try:
    socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2])).close()
except OSError as err:
    print(type(err).__name__, flush=True); sys.exit(1)
print((time.perf_counter() - t) * 1000, flush=True)
"""


def _listen(net: NetShape, i: int) -> subprocess.Popen:
    srv = net.popen(i, [sys.executable, "-c", ACCEPT_ONE, net.local_ip(i)],
                    stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
    return srv


def _connect(net: NetShape, i: int, addr: str, timeout: float = 3.0) -> tuple[int, str]:
    r = net.run(i, [sys.executable, "-c", CONNECT, addr, str(timeout)], capture_output=True,
                text=True, timeout=30)  # fmt: skip
    return r.returncode, r.stdout.strip()


@pytest.mark.skipif(NAT_REASON is not None, reason=f"no NAT: {NAT_REASON}")
def test_a_node_behind_nat_connects_out_and_nobody_connects_in():
    with NetShape(3, 0, nat=[2]) as net:
        assert net.local_ip(2) != net.ip(2) and net.local_ip(0) == net.ip(0)
        srv = _listen(net, 0)
        assert _connect(net, 2, net.ip(0))[0] == 0
        assert srv.stdout.readline().strip() == net.ip(2)  # seen as its router's address
        _listen(net, 2)
        for addr in (net.ip(2), net.local_ip(2)):  # the router's, and the private one
            code, why = _connect(net, 0, addr)
            assert code == 1, (addr, why)
        assert _connect(net, 1, net.ip(0))[0] == 0  # the others still reach each other
    assert _ours(net) == set() and not set(net.routers.values()) & set(list_namespaces())


@pytest.mark.skipif(WIRE_REASON is not None, reason=f"no wire: {WIRE_REASON}")
def test_a_wire_delays_and_loses_what_it_is_told_to():
    with NetShape(2, 0, wired=[1], delay_ms=60) as net:
        _listen(net, 1)
        _connect(net, 0, net.ip(1))  # the first also waits for ARP, delayed too
        code, ms = _connect(net, 0, net.ip(1))
        assert code == 0 and 110 < float(ms) < 400, ms  # SYN and SYN-ACK: 2 x 60 ms
        net.set_wire(1, 0, 0)
        time.sleep(0.3)  # frames already queued drain first
        code, ms = _connect(net, 0, net.ip(1))
        assert code == 0 and float(ms) < 60, ms
        net.set_wire(1, 0, 100)  # every frame lost
        time.sleep(0.1)
        assert _connect(net, 0, net.ip(1), timeout=1.0) == (1, "TimeoutError")
        with pytest.raises(ValueError, match="no wire"):
            net.set_wire(0, 10, 0)
    assert not set(net.wires.values()) & set(list_namespaces())


UDP_COUNT = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 7001))
s.settimeout(1.5); print("ready", flush=True); n = 0
try:
    while True:
        s.recv(64); n += 1
except TimeoutError:
    print(n, flush=True)
"""

UDP_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    s.sendto(b"x", (sys.argv[1], 7001)); time.sleep(0.001)
"""


def _delivered(net: NetShape, src: int, dst: int, n: int) -> int:
    recv = net.popen(dst, [sys.executable, "-c", UDP_COUNT, net.ip(dst)],
                     stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    net.run(src, [sys.executable, "-c", UDP_SEND, net.ip(dst), str(n)], check=True)
    return int(recv.stdout.readline())


@pytest.mark.skipif(NAT_REASON is not None, reason=f"no nft: {NAT_REASON}")
def test_loss_on_the_bridge_drops_that_share_and_heals():
    with NetShape(2, 0) as net:
        _delivered(net, 0, 1, 5)  # ARP settled
        net.set_loss(1, 30.0)
        got = _delivered(net, 0, 1, 400)
        assert 220 < got < 340, got  # 70 % of 400 = 280
        net.set_loss(1, 0)
        assert _delivered(net, 0, 1, 400) == 400
        with pytest.raises(ValueError):
            net.set_loss(1, 101)
