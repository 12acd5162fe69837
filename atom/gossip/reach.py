"""Is this peer reachable from the group? What the members that answered its pings say.

Each member pings every peer it hears from, at the endpoint that peer advertises
(gossip.advertise, default the --listen address); a pong tells the pinger whether the
member's own pings to it got through (`reach`). One member that got through makes this
peer a **member**: others may start exchanges with it. None, after at least one said no,
makes it a **client** (behind a NAT or a firewall): it starts every exchange itself over its
own outgoing connections and the reply carries the member's side, so both ends still mix;
members neither choose it as a partner nor list it to others (two clients never meet),
and ping its endpoint only now and then (membership.py) in case a port gets forwarded.
"""

from __future__ import annotations

import logging
import threading

MAX_VERDICTS = 256  # members remembered (a bound, as the peer table has)


class Reachability:
    def __init__(self, log: logging.LoggerAdapter, endpoint: str = ""):
        self.log, self.endpoint = log, endpoint
        self.mode = "unknown"  # member | client | unknown (no member has said yet)
        self._verdicts: dict[str, bool] = {}
        self._lock = threading.Lock()

    def verdict(self, member: str, reachable: bool) -> None:
        """A member's word on our endpoint; one line when our mode changes."""
        with self._lock:
            if member not in self._verdicts and len(self._verdicts) >= MAX_VERDICTS:
                return
            self._verdicts[member] = reachable
            mode = "member" if any(self._verdicts.values()) else "client"
            if mode == self.mode:
                return
            self.mode = mode
        if mode == "member":
            self.log.info("reachable at %s (%s got through)", self.endpoint, member)
        else:
            self.log.warning("%s", self.client_line(member))

    def client_line(self, member: str) -> str:
        port = self.endpoint.rsplit(":", 1)[-1]
        return (
            f"not reachable from the group at {self.endpoint} ({member} could not connect): "
            "joining as a client: you exchange with "
            "reachable members, they cannot start exchanges with you; forward port "
            f"{port} on your router to this machine (and set gossip.advertise to the "
            "address others dial), or join over a private network (docs/peers.md), to be a "
            "full member"
        )
