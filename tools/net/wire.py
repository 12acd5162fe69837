"""A wire with latency and loss, in user space: netem's job where netem is missing.

    ip netns exec <ns> python -m tools.net.wire tapA tapB --delay-ms 100 --loss 1

Forwards Ethernet frames between two existing TAP devices of this namespace (each the
port of a bridge: see tools/net/shape's ``wire``), holding every frame ``--delay-ms`` in
each direction and dropping ``--loss`` percent of them, independently and at random. A
link built this way has a round trip of twice the delay plus the queueing the kernel's
rate limits add. The kernel this was built on has no sch_netem, and a consumer internet
link (200 ms, a few Mb/s, 1% loss) is what issue 29's timeouts must survive.

The delay and loss can change while frames flow: each line on standard input,
"DELAY_MS LOSS_PERCENT", replaces both (tools/net/shape's ``set_wire``). The relay stops
on end of input, SIGTERM or SIGINT. Frames keep their order in each direction.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536
MAX_QUEUED = 4096  # frames per direction; beyond this the wire drops (a full buffer)


def open_tap(name: str) -> int:
    """Attach to the persistent TAP device `name` of this namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Direction:
    """Frames read from one tap, due for writing to the other after the delay."""

    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self.queue: deque[tuple[float, bytes]] = deque()
        self.passed = self.dropped = 0

    def take(self, frame: bytes, now: float, delay_s: float, loss: float, rng) -> None:
        if rng.random() * 100.0 < loss or len(self.queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        due = now + delay_s
        if self.queue and due < self.queue[-1][0]:
            due = self.queue[-1][0]  # a shorter new delay never reorders frames
        self.queue.append((due, frame))

    def flush(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, frame = self.queue.popleft()
            try:
                os.write(self.dst, frame)
                self.passed += 1
            except BlockingIOError:
                self.dropped += 1  # the far side's queue is full: the frame is lost
            except OSError:
                self.dropped += 1  # no carrier yet (the bridge port is coming up)

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None


def parse_line(line: str) -> tuple[float, float]:
    delay, loss = (float(x) for x in line.split())
    if delay < 0 or not 0 <= loss <= 100:
        raise ValueError(f"delay must be >= 0 ms and loss within 0..100 %, got {line!r}")
    return delay / 1000.0, loss


def relay(tap_a: str, tap_b: str, delay_ms: float, loss: float, seed: int | None) -> None:
    a, b = open_tap(tap_a), open_tap(tap_b)
    rng = random.Random(seed)
    delay_s = delay_ms / 1000.0
    ways = {a: Direction(a, b), b: Direction(b, a)}
    control = sys.stdin.fileno()
    watch = [a, b, control]
    pending = b""
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        dues = [d for d in (w.next_due() for w in ways.values()) if d is not None]
        timeout = max(0.0, min(dues) - now) if dues else 1.0
        readable, _, _ = select.select(watch, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd == control:
                chunk = os.read(control, 4096)  # raw reads: a buffered stdin hides lines
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip():
                        delay_s, loss = parse_line(line.decode())
                continue
            for _ in range(64):  # drain a burst, bounded so the other side is served
                try:
                    frame = os.read(fd, MAX_FRAME)
                except (BlockingIOError, OSError):
                    break
                ways[fd].take(frame, now, delay_s, loss, rng)
        for way in ways.values():
            way.flush(now)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tap_a")
    ap.add_argument("tap_b")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    ap.add_argument("--loss", type=float, default=0.0, help="percent of frames dropped")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    if args.delay_ms < 0 or not 0 <= args.loss <= 100:
        ap.error("--delay-ms must be >= 0 and --loss within 0..100")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        relay(args.tap_a, args.tap_b, args.delay_ms, args.loss, args.seed)
    except KeyboardInterrupt:
        pass
    except OSError as err:
        print(f"netwire: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
