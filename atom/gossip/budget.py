"""How far other peers may move a unit of ours: exchanges served per window, per sender
and in all, and an alarm when a unit's norm collapses or explodes under gossip.

Every served exchange moves one of our units toward a peer that asked, and in an open
group anyone may ask under any number of names. Per exchange the robust merge bounds the
move (robust.py); over time nothing did: one peer zeroed a member's weights in 2 s with
requests from five ids, and a single id taking 2%-of-the-norm steps toward zeros had 476
exchanges merged in 16 s (an honest partner: 105) and took 55-60% of three units' norms.
So a unit is served, in any window of WINDOW_PERIODS schedule periods (a period is H of
our own optimizer steps under an outer optimizer, the time our own lanes take to start
one exchange of every unit under plain averaging: what one honest partner's schedule
allows):

- at most PER_SENDER exchanges per sender, and PER_UNIT in all, whoever asks: beyond
  that the request is answered `busy` (an honest partner backs off a moment and tries
  another; nothing is penalised);
- at most MOVE yardsticks of movement in all (beta x trust x the clipped difference,
  relative to the unit's norm; the yardstick is the typical difference of the partners
  this peer chose itself, robust.py), past the window's first exchange (itself bounded
  by the clip): a request beyond it is answered `busy`;
- senders whose endpoint never answered our own ping (clients behind a NAT, and any id
  an attacker invents without a listener behind it) count as one sender, UNPROVEN.

So an attacker with any number of ids moves a unit, over any window, at most as far as
PER_UNIT honest exchanges would, and the partners this peer picks (by measured link, its
own pings) keep mixing it back. Served exchanges are only half of mixing: every peer
also starts exchanges with partners it chose, which no budget here limits.

The alarm is the backstop for what gets past the bounds (a partner we chose that lies
within them, for long): a unit whose norm fell below 1/COLLAPSE of what it was within
ALARM_PERIODS periods, while gossip moved it by at least ALARM_MOVE of its norm there
(so it was gossip's doing: a zeroed unit), makes the trainer roll back to its newest
checkpoint and stop mixing with every peer merged since (atom/run/train.py, as for
non-finite weights). Only a collapse: honest training grows a unit's norm 2.4x within
eight periods (three tiny peers on disjoint shards, with their outer steps moving each
unit 0.76 of its norm), and weights blown up are the guard's (train.max_abs_weight).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

WINDOW_PERIODS = 2  # the window the counts below apply to, in schedule periods
PER_SENDER = 4  # served exchanges of a unit per sender per window
# served exchanges of a unit per window, all senders together: what one honest partner's
# schedule allows at most (an outer optimizer asks again every H/4 steps while it
# distrusts its partners, 8 times in 2 H; half of that per sender cost a group of three
# on disjoint shards 18% of its exchanges and ~3% of val loss)
PER_UNIT = 8
MOVE = 4.0  # served movement of a unit per window, in yardsticks (an honest one: ~0.5)
UNPROVEN = "(unproven senders)"  # every sender whose endpoint we never reached: one
ALARM_PERIODS = 8
COLLAPSE = 4.0
ALARM_MOVE = 0.5
ALARM_KEEP = 256  # entries per unit the alarm remembers (bounded whatever the rate)


class ServeBudget:
    """Served exchanges and their movement, per unit, over a sliding window of the
    schedule's clock (`clock()`: our optimizer step, or seconds; `period`: one period
    in that clock's units). Thread-safe: the server's workers call it."""

    def __init__(self, clock: Callable[[], float], period: float):
        if not period > 0:
            raise ValueError(f"the budget's period must be > 0, got {period}")
        self.clock, self.period = clock, period
        self._served: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._norms: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=ALARM_KEEP)
        )
        self._lock = threading.Lock()
        self._alarm: str | None = None

    def _recent(self, unit: int, now: float) -> collections.deque:
        served = self._served[unit]
        while served and now - served[0][0] >= WINDOW_PERIODS * self.period:
            served.popleft()
        return served

    def admit(self, unit: int, sender: str) -> str | None:
        """Count a request for `unit` from `sender` (UNPROVEN for one we never reached);
        None if it may be served, else why not. A counted request stays counted, served
        or not: failing an exchange on purpose must not refill anyone's allowance."""
        now = self.clock()
        with self._lock:
            served = self._recent(unit, now)
            if len(served) >= PER_UNIT:
                return f"unit {unit} served {len(served)} exchanges this window"
            if sum(1 for _, s, _ in served if s == sender) >= PER_SENDER:
                return f"unit {unit} served this sender {PER_SENDER} times this window"
            served.append([now, sender, 0.0])
            return None

    def allow_move(self, unit: int, sender: str, move: float, yardstick: float) -> bool:
        """Whether a served move (relative to the unit's norm) fits the window's MOVE x
        yardstick; recorded against the request admit() counted when it does. Not merged
        in part: both ends merge an exchange alike (plain averaging keeps the group's mean
        only so), and a refused one changes neither."""
        with self._lock:
            served = self._recent(unit, self.clock())
            used = sum(m for _, _, m in served)
            if used > 0 and used + move > MOVE * yardstick:  # the window's first always fits
                return False
            for entry in reversed(served):  # this sender's latest admitted request
                if entry[1] == sender and entry[2] == 0.0:
                    entry[2] = move
                    break
            return True

    # ------------------------------------------------------------ the alarm
    def moved(self, unit: int, norm: float, move: float) -> None:
        """Any merge of `unit` (served or started by us): its norm before, and how far the
        merge moved it (relative to that norm). Sets the alarm (take_alarm) when the unit's
        norm fell below 1/COLLAPSE of a norm it had within ALARM_PERIODS while gossip moved
        it by at least ALARM_MOVE of its norm there."""
        now = self.clock()
        with self._lock:
            seen = self._norms[unit]
            while seen and now - seen[0][0] >= ALARM_PERIODS * self.period:
                seen.popleft()
            seen.append((now, norm, move))
            top = max(n for _, n, _ in seen)
            gossip = sum(m for _, _, m in seen)
            if norm * COLLAPSE < top and gossip >= ALARM_MOVE and self._alarm is None:
                self._alarm = (
                    f"gossip moved unit {unit} by {gossip:.2f} of its norm lately, and its "
                    f"norm fell from {top:.3g} to {norm:.3g}: far more than its own training "
                    "does (a peer pulling it to zero?)"
                )
                seen.clear()  # the rollback starts it afresh

    def take_alarm(self) -> str | None:
        """The alarm's message once (then cleared), or None."""
        with self._lock:
            alarm, self._alarm = self._alarm, None
            return alarm
