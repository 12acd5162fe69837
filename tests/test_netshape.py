"""tools/netshape: namespaces come up shaped and connected, and always go away.

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

from tools import netshape
from tools.netshape import NetShape, available, list_namespaces, measure_mbps, rate_matrix

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
from tools.netshape import NetShape
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
