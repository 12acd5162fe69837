"""The soak's faults (tools/net/soak.py): a seeded schedule a user can replay, and how each
fault is done to a peer or to the network.

Kinds, and what each does:

    kill_resume   SIGKILL mid-step (or mid-save), restart with --resume, same address
    kill_move     SIGKILL, restart with --resume on a new port (a new address)
    kill_fresh    SIGKILL, restart as a fresh joiner (a new run directory)
    term_restart  SIGTERM (a clean stop, its checkpoint), restart with --resume
    pause         SIGSTOP for longer than gossip.dead_after_s, then SIGCONT
    disk_full     the peer's run directory (a small tmpfs) filled, then freed
    partition     the group split in two (blackhole routes both ways), then healed
    slow_link     one peer's links shaped to 1 Mb/s with 2% of its frames lost each way
                  (loss needs nft; delay needs netem, missing on the machines this was
                  built on: tools/bench/wan measures a 200 ms link instead)
    flap          one peer's link down and up every second
    late_join     a peer that was not there joins
    leave         a peer leaves for good (Ctrl+C)

The network kinds need network namespaces (root, `ip netns`); disk_full needs root for
the tmpfs. Without them those kinds are left out of the schedule, and the report says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = (
    "kill_resume", "kill_move", "kill_fresh", "term_restart", "pause", "disk_full",
    "partition", "slow_link", "flap", "late_join", "leave",
)  # fmt: skip
NETWORK_KINDS = {"partition", "slow_link", "flap"}
ROOT_KINDS = {"disk_full"}
# nominal seconds a fault is held (min, max); shortened to fit short runs
HOLD_S = {
    "kill_resume": (2, 6), "kill_move": (2, 6), "kill_fresh": (2, 6), "term_restart": (1, 3),
    "pause": (4, 8), "disk_full": (10, 30), "partition": (30, 120), "slow_link": (20, 60),
    "flap": (10, 30), "late_join": (0, 0), "leave": (0, 0),
}  # fmt: skip
RECOVER_S = 8.0  # after a fault ends: what it caused (refused messages, a rejoin) settles


@dataclass
class Fault:
    at: float  # seconds after the start
    kind: str
    hold: float  # seconds the fault lasts (a kill: until the restart)
    target: int = -1  # a peer slot, chosen when the fault starts (who is up then)
    detail: str = ""  # what was done, for the report

    @property
    def ends(self) -> float:
        return self.at + self.hold


def schedule(
    seed: int, seconds: float, kinds: list[str], warmup_s: float, min_each: int = 1
) -> list[Fault]:
    """Faults one at a time, from warmup_s to a quiet tail (where recovery is judged):
    first `min_each` of every kind (shuffled), then more drawn at random while time is
    left. The same seed and arguments give the same schedule."""
    rng = random.Random(seed)
    # the quiet tail: a peer restarted by the last fault has time to start (mostly
    # importing torch: 10-20 s on a loaded 2-core box) and train before the end is judged
    end = seconds - max(30.0, 0.1 * seconds)
    first = [k for _ in range(min_each) for k in kinds]
    rng.shuffle(first)
    slot = (end - warmup_s) / max(1, len(first))
    if slot < 4.0:
        raise ValueError(f"{len(first)} faults do not fit in {seconds:.0f} s: give more --minutes")
    recover = min(RECOVER_S, slot / 2)
    faults, t = [], warmup_s
    while True:
        kind = first.pop(0) if first else rng.choice(kinds)
        lo, hi = HOLD_S[kind]
        hold = max(1.0, min(rng.uniform(lo, hi), slot - recover)) if hi else 0.0
        if t + hold + recover > end + 1e-6:
            break
        faults.append(Fault(round(t, 1), kind, round(hold, 1)))
        t += max(slot, hold + recover)
    return faults


def usable_kinds(netns: bool, root: bool) -> tuple[list[str], list[str]]:
    """(kinds this machine can do, kinds left out and why, as lines)."""
    out, left = [], []
    for k in KINDS:
        if k in NETWORK_KINDS and not netns:
            left.append(f"{k}: needs network namespaces (root and `ip netns`)")
        elif k in ROOT_KINDS and not root:
            left.append(f"{k}: needs root (a tmpfs run directory)")
        else:
            out.append(k)
    return out, left
