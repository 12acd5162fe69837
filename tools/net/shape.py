"""Kernel-shaped links between network namespaces: N "machines" on one host.

    sudo .venv/bin/python -m tools.net.shape demo --nodes 4 --mbps 20   # build, measure, tear down
    sudo .venv/bin/python -m tools.net.shape demo --nodes 3 --mbps 100 --pair 0 2 --megabytes 4
    sudo .venv/bin/python -m tools.net.shape cleanup                    # leftovers of killed runs

Topology: one hub namespace holding a bridge, and N node namespaces, each joined to the
bridge by a veth pair (``eth0`` inside the node, ``10.213.0.(i+1)/24``). Traffic never
leaves the namespaces made here (none has a route out; the host's own namespace is not
on the bridge).

Shaping: every node's ``eth0`` egress gets an htb qdisc with one class per destination
(u32 match on the destination address), so ``rates[i][j]`` Mb/s caps the link i -> j and
the reverse direction is capped on j's side: a full mesh of independent point-to-point
links, i.e. a link matrix. A rate of 0 leaves the link unshaped (it falls into the default
class, as ARP does). Each class feeds a bfifo sized to 200 ms of traffic (at least
128 KiB): a consumer link's buffer. netem and fq_codel are not available on the machine
this was built on: a node in ``wired`` is joined to the bridge through tools/net/wire, a
user-space relay that delays (``delay_ms`` one way, each direction) and drops (``loss``
percent) its frames; ``set_wire`` changes both while traffic flows. The other links are
pure rate limits.

NAT: a node in ``nat`` sits behind a router namespace of its own (its address
``10.214.i.2``, the router's ``10.213.0.(i+1)`` on the bridge) that masquerades its traffic
with nftables and forwards no port: it can connect out, nobody can connect in, as behind a
home router. ``ip(i)`` is the address the others see, ``local_ip(i)`` the one a program in
the node binds.

Teardown is idempotent and always runs: on leaving the ``with`` block (also by an
exception or Ctrl+C), on SIGTERM/SIGHUP (turned into SystemExit while a NetShape is
active), and at interpreter exit. Processes started in the namespaces through
:meth:`NetShape.popen` are stopped first (SIGTERM, then SIGKILL), then any process still in
one of our namespaces (listed by ``ip netns pids``: only we start processes there).
Namespaces are named ``atomnet-<pid>-<tag>-<i>``; ``cleanup`` removes those whose creating
process is gone (after a SIGKILL, say).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "atomnet"
IFACE = "eth0"
DEFAULT_SUBNET = "10.213.0"
NAT_SUBNET = "10.214"  # node i behind NAT: 10.214.i.2, its router 10.214.i.1
BUFFER_S = 0.2  # queue per shaped link, in seconds of traffic
MIN_BUFFER = 128 * 1024
UNSHAPED = "10gbit"  # the default class: ARP and unshaped links
QUANTUM = 60000  # htb quantum (bytes): explicit, so tc does not warn at high rates


class NetShapeError(RuntimeError):
    """A namespace, link or qdisc could not be made; the message has ip/tc's stderr."""


def _run(args: Sequence[str], check: bool = True, timeout: float = 30,
         input: str | None = None) -> str:  # fmt: skip
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          input=input)  # fmt: skip
    if check and proc.returncode != 0:
        raise NetShapeError(f"{' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def available() -> str | None:
    """None if this process can make network namespaces, else why not (for skip reasons)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"{PREFIX}-{os.getpid()}-probe{uuid.uuid4().hex[:6]}"
    try:
        _run(["ip", "netns", "add", probe])
    except (OSError, NetShapeError, subprocess.TimeoutExpired) as err:
        return f"ip netns add failed: {err}"
    try:
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "show"])
    except (OSError, NetShapeError, subprocess.TimeoutExpired) as err:
        return f"tc does not work in a namespace: {err}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def nat_available() -> str | None:
    """None if nodes can be put behind NAT (nft masquerade in a namespace), else why not."""
    reason = available()
    if reason is None and not shutil.which("nft"):
        reason = "nft is not installed (apt-get install nftables)"
    return reason


def wire_available() -> str | None:
    """None if links can carry delay and loss (tools/net/wire on TAP devices), else why not."""
    reason = available()
    if reason is None and not os.path.exists("/dev/net/tun"):
        reason = "/dev/net/tun is missing (no TAP devices)"
    return reason


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def rate_matrix(n: int, mbps: float | Sequence[Sequence[float]]) -> list[list[float]]:
    """A uniform rate (every link i -> j) or an n x n matrix (diagonal ignored) in Mb/s."""
    if n < 2:
        raise ValueError(f"need at least 2 nodes, got {n}")
    if isinstance(mbps, (int, float)):
        if mbps < 0:
            raise ValueError(f"rate must be >= 0 Mb/s, got {mbps}")
        return [[0.0 if i == j else float(mbps) for j in range(n)] for i in range(n)]
    rows = [list(map(float, row)) for row in mbps]
    if len(rows) != n or any(len(r) != n for r in rows):
        raise ValueError(f"link matrix must be {n} x {n}")
    if any(v < 0 for r in rows for v in r):
        raise ValueError("link rates must be >= 0 Mb/s")
    return [[0.0 if i == j else rows[i][j] for j in range(n)] for i in range(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces() -> list[str]:
    """Our namespaces whose creating process no longer exists."""
    out = []
    for name in list_namespaces():
        parts = name.split("-")
        ours = len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit()
        if ours and not _pid_alive(int(parts[1])):
            out.append(name)
    return out


def _kill_namespace_pids(names: Sequence[str], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process left in these namespaces (all started by us)."""
    pids = {int(p) for n in names for p in _run(["ip", "netns", "pids", n], check=False).split()}
    pids.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pids.discard(pid)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if _pid_alive(p) and not _reaped(p)}
            time.sleep(0.05)
        if not pids:
            return


def _reaped(pid: int) -> bool:
    """Reap our own zombie children so they stop counting as alive."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return False


def cleanup(names: Sequence[str] | None = None) -> list[str]:
    """Delete the given namespaces (default: the stale ones); returns what was removed."""
    names = list(stale_namespaces() if names is None else names)
    _kill_namespace_pids(names)
    for name in names:
        _run(["ip", "netns", "del", name], check=False)
    return names


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class NetShape:
    """N namespaces on a bridge with per-link rate limits; a context manager.

    >>> with NetShape(4, mbps=20) as net:             # doctest: +SKIP
    ...     p = net.popen(1, ["python3", "-m", "http.server", "--bind", net.ip(1)])
    ...     net.run(0, ["python3", "-c", "..."])
    """

    def __init__(
        self,
        n: int,
        mbps: float | Sequence[Sequence[float]] = 0.0,
        subnet: str = DEFAULT_SUBNET,
        tag: str | None = None,
        buffer_s: float = BUFFER_S,
        nat: Sequence[int] = (),
        wired: Sequence[int] = (),
        delay_ms: float = 0.0,
        loss: float = 0.0,
    ):
        self.n = n
        self.rates = rate_matrix(n, mbps)
        for i in (*nat, *wired):
            if not 0 <= i < n:
                raise ValueError(f"node {i} does not exist (nodes 0..{n - 1})")
        self.nat = frozenset(nat)
        self.wired = frozenset(wired)
        self.wire_settings = (float(delay_ms), float(loss))
        self.subnet = subnet
        self.buffer_s = buffer_s
        tag = tag or uuid.uuid4().hex[:6]
        base = f"{PREFIX}-{os.getpid()}-{tag}"
        self.hub = f"{base}-hub"
        self.nodes = [f"{base}-{i}" for i in range(n)]
        self.routers = {i: f"{base}-r{i}" for i in sorted(self.nat)}
        self.wires = {i: f"{base}-w{i}" for i in sorted(self.wired)}
        self._relays: dict[int, subprocess.Popen] = {}
        self.losses: dict[int, float] = {}
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._old_handlers: dict[int, object] = {}
        self._atexit = False

    # ------------------------------------------------------------ addresses
    def ip(self, i: int) -> str:
        """Node i's address on the shared bridge: its router's, for a node behind NAT."""
        return f"{self.subnet}.{i + 1}"

    def local_ip(self, i: int) -> str:
        """The address node i's own interface holds (what a program there binds)."""
        return f"{NAT_SUBNET}.{i}.2" if i in self.nat else self.ip(i)

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside node i."""
        return ["ip", "netns", "exec", self.nodes[i]]

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> NetShape:
        self._install_signals()
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        if not self._atexit:
            atexit.register(self.down)
            self._atexit = True
        self._add_ns(self.hub)
        hub = ["ip", "-n", self.hub]
        _run(hub + ["link", "add", "br0", "type", "bridge"])
        _run(hub + ["link", "set", "br0", "up"])
        for i, ns in enumerate(self.nodes):
            self._add_ns(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            wan = self._behind_nat(i) if i in self.nat else ns
            port = f"p{i}"
            if i in self.wired:
                self._wire(i, wan, port)
            else:
                _run(["ip", "link", "add", IFACE, "netns", wan, "type", "veth",
                      "peer", "name", port, "netns", self.hub])  # fmt: skip
            _run(hub + ["link", "set", port, "master", "br0"])
            _run(hub + ["link", "set", port, "up"])
            _run(["ip", "-n", wan, "addr", "add", f"{self.ip(i)}/24", "dev", IFACE])
            _run(["ip", "-n", wan, "link", "set", IFACE, "up"])
        self.set_rates(self.rates)
        log.info("netshape: %d namespaces %s..%s up", self.n, self.nodes[0], self.nodes[-1])

    def _behind_nat(self, i: int) -> str:
        """Put node i behind a home router: a namespace that forwards and masquerades its
        private subnet onto the bridge and has no port forwarded. The node can connect out;
        nothing on the bridge can connect in (its private address has no route there, and
        the router's own address has no listener). Returns the router's namespace."""
        router, ns = self.routers[i], self.nodes[i]
        self._add_ns(router)
        lan, gateway = f"{NAT_SUBNET}.{i}", f"{NAT_SUBNET}.{i}.1"
        _run(["ip", "link", "add", IFACE, "netns", ns, "type", "veth",
              "peer", "name", "lan0", "netns", router])  # fmt: skip
        r, node = ["ip", "-n", router], ["ip", "-n", ns]
        _run(r + ["addr", "add", f"{gateway}/24", "dev", "lan0"])
        _run(r + ["link", "set", "lan0", "up"])
        _run(r + ["link", "set", "lo", "up"])
        _run(node + ["addr", "add", f"{lan}.2/24", "dev", IFACE])
        _run(node + ["link", "set", IFACE, "up"])
        _run(node + ["route", "add", "default", "via", gateway])
        inside = ["ip", "netns", "exec", router]
        _run(inside + ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        rules = (
            "table ip nat {\n chain post {\n  type nat hook postrouting priority 100;\n"
            f'  oifname "{IFACE}" ip saddr {lan}.0/24 masquerade\n }}\n}}\n'
        )
        _run(inside + ["nft", "-f", "-"], input=rules)
        return router

    def _wire(self, i: int, wan: str, port: str) -> None:
        """Join `wan`'s eth0 to the hub's `port` through tools/net/wire: two bridges in a
        namespace of their own, each with a TAP device the relay forwards between."""
        w = self.wires[i]
        self._add_ns(w)
        _run(["ip", "link", "add", "name", IFACE, "netns", wan, "type", "veth",
              "peer", "name", "a", "netns", w])  # fmt: skip
        _run(["ip", "link", "add", "name", "b", "netns", w, "type", "veth",
              "peer", "name", port, "netns", self.hub])  # fmt: skip
        inside = ["ip", "netns", "exec", w]
        for side in ("a", "b"):
            _run(inside + ["ip", "tuntap", "add", "dev", f"tap{side}", "mode", "tap"])
            _run(inside + ["ip", "link", "add", f"br{side}", "type", "bridge"])
            for dev in (side, f"tap{side}"):
                _run(inside + ["ip", "link", "set", "dev", dev, "master", f"br{side}"])
                _run(inside + ["ip", "link", "set", "dev", dev, "up"])
            _run(inside + ["ip", "link", "set", f"br{side}", "up"])
        delay_ms, loss = self.wire_settings
        relay = subprocess.Popen(
            inside + [sys.executable, str(Path(__file__).with_name("wire.py")), "tapa",
                      "tapb", "--delay-ms", str(delay_ms), "--loss", str(loss)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=_default_signals,
        )  # fmt: skip
        self._procs.append(relay)
        self._relays[i] = relay
        assert relay.stdout is not None
        if relay.stdout.readline().strip() != "ready":
            raise NetShapeError(f"the wire relay for node {i} did not start")

    def set_loss(self, i: int, percent: float) -> None:
        """Drop `percent` of the frames node i sends and receives, at random, on the hub's
        bridge (nftables, in the kernel: no end's stack sees an error, TCP just loses the
        segment). 0 restores the link. Needs nft (``nat_available``)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"loss must be within 0..100 %, got {percent}")
        self.losses[i] = float(percent)
        rules = []
        for node, pct in sorted(self.losses.items()):
            if pct > 0:
                per_mille = round(pct * 10)
                for way in ("iifname", "oifname"):
                    rules.append(f'  {way} "p{node}" numgen random mod 1000 < {per_mille} drop')
        inside = ["ip", "netns", "exec", self.hub, "nft"]
        _run(inside + ["delete", "table", "bridge", "atomloss"], check=False)
        if not rules:
            return
        table = ("table bridge atomloss {\n chain links {\n  type filter hook forward "
                 "priority 0;\n" + "\n".join(rules) + "\n }\n}\n")  # fmt: skip
        _run(inside + ["-f", "-"], input=table)

    def set_wire(self, i: int, delay_ms: float, loss: float) -> None:
        """Change node i's wire (it must be in `wired`): one-way delay each direction, and
        the percent of frames lost; takes effect for the frames that follow."""
        if i not in self._relays:
            raise ValueError(f"node {i} has no wire (NetShape(..., wired=[{i}]))")
        if delay_ms < 0 or not 0 <= loss <= 100:
            raise ValueError("delay must be >= 0 ms and loss within 0..100 %")
        relay = self._relays[i]
        assert relay.stdin is not None
        relay.stdin.write(f"{delay_ms} {loss}\n")
        relay.stdin.flush()

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)

    def set_rates(self, mbps: float | Sequence[Sequence[float]]) -> None:
        """(Re)shape every link; may be called while processes run."""
        self.rates = rate_matrix(self.n, mbps)
        for i in range(self.n):
            tc = ["ip", "netns", "exec", self.nodes[i], "tc"]
            _run(tc + ["qdisc", "del", "dev", IFACE, "root"], check=False)
            _run(tc + ["qdisc", "add", "dev", IFACE, "root", "handle", "1:", "htb",
                       "default", "999"])  # fmt: skip
            _run(tc + ["class", "add", "dev", IFACE, "parent", "1:", "classid", "1:999", "htb",
                       "rate", UNSHAPED, "quantum", str(QUANTUM)])  # fmt: skip
            for j in range(self.n):
                rate = self.rates[i][j]
                if i == j or rate <= 0:
                    continue
                cls = f"1:{10 + j}"
                limit = max(MIN_BUFFER, int(rate * 1e6 / 8 * self.buffer_s))
                _run(tc + ["class", "add", "dev", IFACE, "parent", "1:", "classid", cls, "htb",
                           "rate", f"{rate:g}mbit", "ceil", f"{rate:g}mbit",
                           "quantum", str(QUANTUM)])  # fmt: skip
                _run(tc + ["qdisc", "add", "dev", IFACE, "parent", cls, "bfifo",
                           "limit", str(limit)])  # fmt: skip
                _run(tc + ["filter", "add", "dev", IFACE, "parent", "1:", "protocol", "ip",
                           "prio", "1", "u32", "match", "ip", "dst", f"{self.ip(j)}/32",
                           "flowid", cls])  # fmt: skip

    def down(self) -> None:
        """Stop our processes, delete our namespaces. Idempotent; never raises."""
        with self._lock:
            try:
                self.stop_processes()
                names = [n for n in self._made if n in set(list_namespaces())]
                _kill_namespace_pids(names)
                for name in reversed(names):
                    _run(["ip", "netns", "del", name], check=False)
                if self._made:
                    log.info("netshape: %d namespaces removed", len(names))
                self._made = []
                self._relays = {}
            except Exception:  # teardown must not mask the error that brought us here
                log.exception("netshape: teardown failed; run `python -m tools.net.shape cleanup`")
            finally:
                self._restore_signals()
                if self._atexit:
                    atexit.unregister(self.down)
                    self._atexit = False

    # ------------------------------------------------------------ signals
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise SystemExit(128 + signum)  # unwinds through __exit__, so down() runs

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    # ------------------------------------------------------------ processes
    def run(
        self, i: int, cmd: Sequence[str], timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """Run cmd inside node i to completion (bounded by timeout)."""
        return subprocess.run(self.prefix(i) + list(cmd), timeout=timeout, **kw)

    def popen(self, i: int, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start cmd inside node i; stopped at teardown if still running. SIGINT and SIGTERM
        are reset to their defaults in the child (a parent started in the background by a
        shell ignores SIGINT, and children would inherit that)."""
        kw.setdefault("preexec_fn", _default_signals)
        proc = subprocess.Popen(self.prefix(i) + list(cmd), **kw)
        self._procs.append(proc)
        return proc

    def stop_processes(self, grace_s: float = 10.0) -> None:
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._procs = []

    def qdisc_report(self, i: int) -> str:
        return _run(["ip", "netns", "exec", self.nodes[i], "tc", "-s", "class", "show",
                     "dev", IFACE])  # fmt: skip


_RECEIVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(60); n = 0
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    n += len(b)
c.sendall(b"k"); print(n, flush=True)
"""

_SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
n = int(sys.argv[3]); t = time.perf_counter()
s.sendall(b"x" * n); s.shutdown(socket.SHUT_WR); s.settimeout(120); s.recv(1)
print(time.perf_counter() - t, flush=True)
"""


def measure_mbps(net: NetShape, src: int, dst: int, nbytes: int, port: int = 5201) -> float:
    """Push nbytes over TCP from node src to node dst; the achieved rate in Mb/s."""
    recv = net.popen(
        dst, [sys.executable, "-c", _RECEIVER, net.ip(dst), str(port)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise NetShapeError("receiver did not start")
        out = net.run(
            src, [sys.executable, "-c", _SENDER, net.ip(dst), str(port), str(nbytes)],
            timeout=180, capture_output=True, text=True, check=True,
        )  # fmt: skip
        seconds = float(out.stdout.strip())
        recv.wait(30)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)
    return nbytes * 8 / seconds / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="build N shaped namespaces, measure one link, tear down")
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--mbps", type=float, default=20.0, help="every link's rate (0: unshaped)")
    d.add_argument("--pair", type=int, nargs=2, default=[0, 1], metavar=("SRC", "DST"))
    d.add_argument("--megabytes", type=float, default=2.0, help="bytes to push over the pair")
    sub.add_parser("cleanup", help="delete namespaces left by killed runs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "cleanup":
        removed = cleanup()
        print(f"removed {len(removed)} stale namespace(s): {' '.join(removed) or '-'}")
        return 0
    reason = available()
    if reason:
        print(f"netshape: {reason}", file=sys.stderr)
        return 2
    with NetShape(args.nodes, args.mbps) as net:
        src, dst = args.pair
        got = measure_mbps(net, src, dst, int(args.megabytes * 1e6))
        print(f"{net.nodes[src]} -> {net.nodes[dst]}: {got:.2f} Mb/s (link {args.mbps:g} Mb/s)")
        print(net.qdisc_report(src))
    print(f"namespaces left: {[n for n in list_namespaces() if n.startswith(PREFIX)]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
