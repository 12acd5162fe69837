"""Why a connection fails before its first message: ZeroMQ's CURVE handshake verdict, read
from a socket monitor, as one line that names the fix.

A keyless peer dialling a keyed group (or the other way round) fails the handshake at
once, on both ends, and no message ever flows: without this the joiner waited out its
join timeout and was told to check the firewall. The joiner watches its seeds' handshakes
(`SeedWatch`); the member words the failures its server sees (`member_note`).
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from atom.gossip.net.keys import GroupKeys, secure_client

FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_MISMATCH = getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002)


def _mechanism_mismatch(event: dict) -> bool:
    return event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and event["value"] == _MISMATCH


def joiner_verdict(event: dict, endpoint: str, keys: GroupKeys | None) -> str | None:
    """What a failed handshake with a seed means for this peer, or None if it succeeded."""
    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    where = f"the member at {endpoint}"
    # a member hanging up mid-handshake, again and again, says no more than that: the
    # mechanism mismatch often looks like it from here (the member closes first)
    if _mechanism_mismatch(event) or (hung_up(event) and keys is None):
        if keys is None:
            return (
                f"{where} belongs to a group with keys: this peer needs its own key bundle "
                "(--group-key DIR, made by `atom keygen` on the group's key directory)"
            )
        return (
            f"{where} runs without a group key: drop --group-key to join it, or restart "
            "that group with keys"
        )
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"{where} does not allow this peer's key ({keys.name if keys else '?'}): add it "
            f"with `atom keygen DIR --peers {keys.name if keys else 'NAME'}` on the group's "
            "key directory and give the members its allowed/ entry (they re-read it)"
        )
    return (
        f"{where} refused this peer's CURVE handshake: it runs with another group's key "
        "(a bundle from another `atom keygen`?) or without one"
    )


def hung_up(event: dict) -> bool:
    """A client that closed its connection mid-handshake (a joiner's seed watch done, a
    peer stopping): no refusal, nothing to count or say."""
    return event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def member_note(event: dict) -> str | None:
    """The member's line for a refused incoming handshake (a refused key is said by the
    allow-list, with its address: None here)."""
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return None
    if _mechanism_mismatch(event):
        return (
            "refused a connection without a group key (a peer started without --group-key: "
            "it is told to add one)"
        )
    return "refused a connection with another group's key (its CURVE handshake failed)"


class SeedWatch:
    """A joiner's view of its seeds' handshakes: one quiet connection per seed, monitored,
    that sends nothing. `refusal()` is one line once every seed refused this peer.

    A member that hangs up mid-handshake says nothing more (zmq's "no detail"): that is what
    a wrong group key looks like from here, and also a member busy reopening its listener,
    so it counts as a refusal only after HANG_UPS in a row (zmq redials every 100 ms)."""

    HANG_UPS = 5

    def __init__(self, ctx: zmq.Context, keys: GroupKeys | None, endpoints: list[str]):
        self.keys = keys
        self._watched: list[tuple[str, zmq.Socket, zmq.Socket]] = []
        self._verdicts: dict[str, str | None] = {}
        self._hang_ups: dict[str, int] = {}
        for endpoint in endpoints:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            secure_client(sock, keys)
            monitor = sock.get_monitor_socket(FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(endpoint)
            self._watched.append((endpoint, sock, monitor))

    def refusal(self) -> str | None:
        for endpoint, _, monitor in self._watched:
            while monitor.poll(0):
                event = recv_monitor_message(monitor)
                if endpoint in self._verdicts:  # a success, or a refusal that said why
                    continue
                if hung_up(event):
                    self._hang_ups[endpoint] = self._hang_ups.get(endpoint, 0) + 1
                    if self._hang_ups[endpoint] < self.HANG_UPS:
                        continue
                else:
                    self._hang_ups[endpoint] = 0
                self._verdicts[endpoint] = joiner_verdict(event, endpoint, self.keys)
        said = [self._verdicts.get(ep, "") for ep, _, _ in self._watched]
        if said and all(said):  # every seed answered, and each refused
            return said[0]
        return None

    def close(self) -> None:
        for _, sock, monitor in self._watched:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        self._watched.clear()
