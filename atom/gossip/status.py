"""What a peer reports: counters, rate-limited warnings, the gossip.json status file, and
`atom peers RUN_DIR` which prints it.

gossip.json (in the run directory, rewritten atomically every heartbeat) holds this
peer's id, endpoint, group, step and counters, and one row per known peer: status, step,
measured link bandwidth and round-trip time, seconds since the last exchange.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from atom.ground.atomic_dir import write_text_atomic

STATUS_FILE = "gossip.json"


class PeerLog(logging.LoggerAdapter):
    """Prefix every record with the peer id: several peers may log into one terminal."""

    def process(self, msg, kwargs):
        return f"[{self.extra['peer']}] {msg}", kwargs


def write_status(run_dir: Path, status: dict[str, Any]) -> None:
    """Atomic: readers (atom peers, tests) never see a half-written file."""
    write_text_atomic(Path(run_dir) / STATUS_FILE, json.dumps(status, indent=1) + "\n")


def read_status(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir)
    if path.is_dir():
        path = path / STATUS_FILE
    return json.loads(path.read_text())


def _fmt_bw(bps: float | None) -> str:
    if not bps:
        return "-"
    mbit = bps * 8 / 1e6
    return f"{mbit / 1000:.2f} Gb/s" if mbit >= 1000 else f"{mbit:.1f} Mb/s"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


_MODE = {
    "member": "reachable (a member)",
    "client": "not reachable: a client (it starts every exchange)",
    "unknown": "reachability not known yet",
}


def format_status(status: dict[str, Any]) -> str:
    """The table `atom peers` prints."""
    age = time.time() - status.get("time", time.time())
    c = status.get("counters", {})
    rejected = sum(v for k, v in c.items() if k.startswith("rejected."))
    wire = status.get("wire") or {}
    per_step = "-"
    if wire.get("sent_per_step") is not None:
        model = wire["model_fp32_bytes"]
        per_step = (
            f"{_fmt_bytes(wire['sent_per_step'])} sent, "
            f"{_fmt_bytes(wire['received_per_step'])} received per step over "
            f"{wire['steps']} steps ({wire['sent_per_step'] / model:.2f}x the fp32 model, "
            f"{_fmt_bytes(model)})"
        )
    lines = [
        f"peer {status['id']} at {status['endpoint'] or '(no address)'} (group {status['group']}), "
        f"step {status['step']}, {status['strategy']}/{status['selection']}/{status['codec']}; "
        f"{status.get('state', 'running')}, {_MODE.get(status.get('mode'), 'mode unknown')}, "
        f"status written {age:.0f}s ago",
        f"exchanges {int(c.get('exchange.ok', 0))} ok, {int(c.get('exchange.failed', 0))} "
        f"failed, {int(c.get('served.ok', 0))} served; rejected {int(rejected)}; "
        f"auth denied {int(c.get('auth.denied', 0) + c.get('auth.handshake_failed', 0))}",
        f"wire: {per_step}",
        "",
        f"{'peer':<20} {'status':<8} {'step':>8} {'link':>12} {'rtt':>9} {'last exch':>10} "
        f"{'exch':>6} {'fail':>5} {'apart':>7}",
    ]
    for p in status.get("peers", []):
        rtt = f"{p['rtt'] * 1000:.1f} ms" if p.get("rtt") else "-"
        last = f"{p['last_exchange_s']:.1f}s ago" if p.get("last_exchange_s") is not None else "-"
        # how far apart the two models were at the last exchange: |theirs - ours|^2 / |ours|^2
        apart = f"{p['apart']:.1e}" if p.get("apart") is not None else "-"
        shown = "client" if p["status"] == "alive" and p.get("reachable") is False else p["status"]
        lines.append(
            f"{p['id'][:20]:<20} {shown:<8} {p['step']:>8} {_fmt_bw(p.get('bw')):>12} "
            f"{rtt:>9} {last:>10} {p['exchanges']:>6} {p['failures']:>5} {apart:>7}"
        )
    if not status.get("peers"):
        lines.append("(no other peers known)")
    return "\n".join(lines)
