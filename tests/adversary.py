"""A scripted hostile peer that speaks the real protocol (wire.py headers over a ZeroMQ
DEALER, CURVE when given a member's key bundle), for the attack tests
(tests/test_adversary.py) and the attack benchmark (tools/bench/attacks.py).

It sends exactly what it is told, valid or not, in anyone's name:

    adv = Adversary(target_peer_endpoint, group=peer.group, fingerprint=peer.params.fingerprint)
    adv.request(adv.header("ping", to="a", **{"from": "b"}))      # speak as b
    adv.send_raw(frames); adv.send_raw(frames)                    # replay a message
    adv.endless_multipart(frame_bytes, seconds)                   # never send the last frame

and a poisoning member: a real `atom train` peer whose every exchange and state reply
carries poison in place of its weights, claiming an averaging weight of 1e18:

    python -m tests.adversary poison MODE -- TRAIN ARGS...      (MODE: see POISONS)

Nothing here is imported by atom/: an attack is a test's tool, not a product feature.
"""

from __future__ import annotations

import itertools
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zmq
import zmq.auth

from atom.gossip.net.handshake import SeedWatch
from atom.gossip.net.keys import GroupKeys, load_bundle
from atom.gossip.net.wire import PROTOCOL


def find_owner(ctx: zmq.Context, keys: GroupKeys, endpoint: str, timeout: float = 10.0) -> str:
    """The member listening at `endpoint` in a keyed group: the allow-listed name whose key
    completes the handshake (as a joiner finds its seed's owner)."""
    watch = SeedWatch(ctx, keys, [endpoint])
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if watch.owner(endpoint) or watch.refusal():
                return watch.owner(endpoint) or ""
            time.sleep(0.02)
        return ""
    finally:
        watch.close()


class Adversary:
    def __init__(
        self,
        endpoint: str,
        group: str,
        fingerprint: str,
        bundle: str | Path | None = None,
        name: str = "mallory",
    ):
        self.endpoint, self.group, self.fingerprint, self.name = endpoint, group, fingerprint, name
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndhwm = 0  # a flood is not throttled here, only by the target
        self.server = ""  # keyed: the member found at `endpoint` (whose key we dial)
        if bundle is not None:  # a member's key: passes the handshake, then lies
            keys = load_bundle(bundle)
            self.server = find_owner(self.ctx, keys, endpoint)
            self.sock.curve_publickey, self.sock.curve_secretkey = keys.public, keys.secret
            self.sock.curve_serverkey = keys.key_of(self.server)
        self.sock.connect(endpoint)
        self.rids = itertools.count(1)

    def header(self, kind: str, to: str = "", **over: Any) -> dict[str, Any]:
        """A header that passes the wire's checks (then `over` changes what it likes)."""
        h = {
            "v": PROTOCOL, "kind": kind, "group": self.group, "fp": self.fingerprint,
            "from": self.name, "to": to, "inc": 1, "ep": "tcp://127.0.0.1:9",
            "rid": next(self.rids), "step": 0, "samples": 4, "ready": True,
        }  # fmt: skip
        h.update(over)
        return h

    def exchange_header(self, to: str, unit: int, n: int, **over: Any) -> dict[str, Any]:
        h = self.header("xreq", to, unit=unit, codec="fp32", weight=4.0, delta=False)
        h["tensors"] = [{"dtype": "f32", "n": n}]
        h.update(over)
        return h

    def frames(self, header: dict[str, Any], *tensors: np.ndarray) -> list[bytes]:
        return [msgpack.packb(header), *(np.ascontiguousarray(t).tobytes() for t in tensors)]

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def request(self, header: dict[str, Any], *tensors: np.ndarray, timeout: float = 2.0):
        """Send and wait for the reply with the same rid: its header, or None."""
        self.send_raw(self.frames(header, *tensors))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
                break
            parts = self.sock.recv_multipart()
            reply = msgpack.unpackb(parts[0], raw=False)
            if reply.get("rid") == header["rid"]:
                return reply
        return None

    def endless_multipart(self, frame_bytes: int, seconds: float, total_bytes: int) -> int:
        """Frames of one message that never ends (each with the MORE flag), for `seconds`
        or until `total_bytes`; returns the bytes sent."""
        chunk = bytes(frame_bytes)
        sent = 0
        deadline = time.monotonic() + seconds
        self.sock.send(msgpack.packb(self.header("ping")), zmq.SNDMORE)
        while sent < total_bytes and time.monotonic() < deadline:
            try:
                self.sock.send(chunk, zmq.SNDMORE | zmq.NOBLOCK)
                sent += frame_bytes
            except zmq.Again:
                time.sleep(0.001)
        return sent

    def endless_zmtp(self, frame_bytes: int, seconds: float, total_bytes: int) -> int:
        """The same over a raw TCP socket speaking ZMTP 3.0 (NULL mechanism): a zmq
        socket never hands an unfinished message to the network (its own pipe holds it),
        but a hand-written client can. Returns the bytes the target took."""
        host, port = self.endpoint.removeprefix("tcp://").rsplit(":", 1)
        greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
        greeting += bytes(32)  # as-server 0, filler
        ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        frame = b"\x03" + frame_bytes.to_bytes(8, "big") + bytes(frame_bytes)  # MORE | LONG
        sent = 0
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
            s.settimeout(1.0)
            deadline = time.monotonic() + seconds
            while sent < total_bytes and time.monotonic() < deadline:
                try:
                    s.sendall(frame)
                except (TimeoutError, OSError):
                    break
                sent += frame_bytes
        return sent

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


LISTEN = ("--listen", "tcp://127.0.0.1:0")


class ConnectionFlood:
    """`n` TCP connections to host:port held open, each one that the server drops opened
    again at once (what a flooder does after every listener recycle), until stop().

        with ConnectionFlood(host, port, 400):
            ...  # the target runs under the flood
    """

    def __init__(self, host: str, port: int, n: int, every_s: float = 0.01):
        import threading

        self.addr, self.n, self.every_s = (host, port), n, every_s
        self.opened = 0  # connections made, reconnections included
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> ConnectionFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import select

        socks: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                while len(socks) < self.n and not self._stop.is_set():
                    try:
                        socks.append(socket.create_connection(self.addr, timeout=0.5))
                        self.opened += 1
                    except OSError:
                        break  # being recycled (or gone): try again in a moment
                # a dropped connection reads as ready with nothing (or an error) to read
                ready, _, _ = select.select(socks, [], [], 0) if socks else ([], [], [])
                for sk in ready:
                    try:
                        gone = sk.recv(4096, socket.MSG_DONTWAIT) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    if gone:
                        sk.close()
                        socks.remove(sk)
                self._stop.wait(self.every_s)
        finally:
            for sk in socks:
                sk.close()


KEYED = ("alice", "bob", "dave")  # honest_group's members h0, h1, h2 in a keyed group


def honest_group(root: Path, steps: int, poison: str | None, honest: tuple = (),
                 keys: Path | None = None, during=None) -> dict:  # fmt: skip
    """Three honest peers (and, with `poison`, one poisoner) on loopback; their results.
    `honest`: more `atom train` arguments for the honest peers (e.g. their guards off).
    `keys`: an `atom keygen` directory holding bundles for KEYED (h0, h1, h2 train with
    them). `during(procs, runs)`: called once all three have started, before waiting
    for them to finish (a bench watches them there)."""
    from tests import gossip_util as gu

    shards, union = gu.make_shards(root)
    runs = [root / f"h{k}" for k in range(3)]
    common = ("--set", "gossip.wait_peers=2", "--set", "train.ckpt_interval=25", *honest)
    key = lambda k: ("--group-key", str(keys / KEYED[k])) if keys else ()  # noqa: E731
    first = gu.peer_cmd(runs[0], shards[0], steps, 1, *LISTEN, *common, *key(0))
    procs = [gu.start(first, root / "h0.log")]
    ep = gu.endpoint(runs[0], procs=procs)
    for k in (1, 2):
        cmd = gu.peer_cmd(runs[k], shards[k], steps, 1 + k, *LISTEN, "--join", ep, *common,
                          *key(k))  # fmt: skip
        procs.append(gu.start(cmd, root / f"h{k}.log"))
    bad = None
    if poison is not None:
        # the honest peers' settings too: a member of another strategy is only refused
        train = gu.peer_cmd(root / "p", shards[0], 10 * steps, 9, *LISTEN, "--join", ep,
                            *honest, "--set", "gossip.interval_s=0.01")[3:]  # fmt: skip
        cmd = [sys.executable, "-m", "tests.adversary", "poison", poison, "--", *train]
        bad = gu.start(cmd, root / "p.log")
    t0 = time.monotonic()
    if during is not None:
        try:
            during(procs, runs)
        except BaseException:
            gu.stop_all(procs, timeout=0)  # nothing is left running
            raise
    codes = gu.stop_all(procs, timeout=180)
    wall = time.monotonic() - t0
    if bad is not None:
        bad.kill()
        bad.wait(10)
    losses = [gu.val_loss(r, union) for r in runs]
    worst = 0.0
    finite = True
    for r in runs:
        for ckpt in sorted((r / "checkpoints").glob("step_*")):
            for t in gu.params(ckpt).values():
                finite &= bool(torch.isfinite(t).all())
                worst = max(worst, float(t.abs().max()))
    counters = [gu.status(r).get("counters", {}) for r in runs]
    total = lambda key: int(sum(c.get(key, 0) for c in counters))  # noqa: E731
    return {
        "codes": codes,
        "val_loss": losses,
        "mean_val_loss": sum(losses) / 3,
        "max_abs_weight": worst,
        "finite": finite,
        "refused": total("rejected.outlier") + total("rejected.nonfinite"),
        "served_refused": total("served.refused"),
        # what the serve budget (atom/gossip/budget.py) answered busy, of what was served
        "budget_busy": total("served.budget") + total("served.moved"),
        "served_ok": total("served.ok"),
        "wall_s": wall,
    }


# what a poisoning member sends in place of a unit's weights x
POISONS = {
    "flip": lambda x: -x,  # the difference is -2x: right at gossip.max_relative
    "random": lambda x: torch.randn_like(x) * (x.norm() / max(x.numel(), 1) ** 0.5),
    "huge": lambda x: x * 1e30,  # refused outright (beyond max_relative)
    "nan": lambda x: torch.full_like(x, float("nan")),  # refused by the wire
}


def poisoner(mode: str, argv: list[str]) -> int:
    """Run `atom train argv` as a peer that sends POISONS[mode] and claims weight 1e18."""
    from atom.cli import main
    from atom.gossip.merge import UnitParams
    from atom.gossip.peer import GossipPeer

    poison = POISONS[mode]
    honest = UnitParams.snapshot

    def snapshot(self, unit):
        return poison(honest(self, unit)).contiguous()

    UnitParams.snapshot = snapshot
    UnitParams.add = lambda self, unit, delta: None  # it takes nothing in: stays alive
    GossipPeer.weight = lambda self: 1e18
    return main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "poison" or sys.argv[3] != "--":
        sys.exit("usage: python -m tests.adversary poison MODE -- TRAIN ARGS...")
    sys.exit(poisoner(sys.argv[2], sys.argv[4:]))
