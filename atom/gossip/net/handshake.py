"""Why a connection fails before its first message: ZeroMQ's CURVE handshake verdict, read
from a socket monitor, as one line that names the fix.

A keyless peer dialling a keyed group (or the other way round) fails the handshake at
once, on both ends, and no message ever flows: without this the joiner waited out its
join timeout and was told to check the firewall. The joiner watches its seeds' handshakes
(`SeedWatch`); the member words the failures its server sees (`member_note`).
"""

from __future__ import annotations

import socket
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from atom.config.gossip import is_loopback
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
    return (
        "refused a connection with another group's key, or one that dialled this member as "
        "another member (its CURVE handshake failed; a joiner given --join tcp://... alone "
        "tries the group's keys to find who listens here)"
    )


class SeedWatch:
    """A joiner's view of its seeds' handshakes: quiet connections, monitored, that send
    nothing. `refusal()` is one line once every seed refused this peer; `owners` names the
    member found at each seed (keyed groups: the name whose key completed the handshake).

    Keyless, one connection per seed. Keyed, a seed is dialled with the key of the member
    named for it (`--join NAME@tcp://...`) or, its owner unknown, with each allow-listed key
    in turn (PROBES at a time): a member serves with its own key, so only its own name's
    completes the handshake (the others hang up at once: the member cannot open them).

    A member that hangs up mid-handshake says nothing more (zmq's "no detail"): that is what
    a wrong key looks like from here, and also a member busy reopening its listener, so it
    counts as a refusal only after HANG_UPS in a row (zmq redials every 100 ms)."""

    HANG_UPS = 5
    PROBES = 8  # keys tried on one seed at once

    def __init__(
        self,
        ctx: zmq.Context,
        keys: GroupKeys | None,
        endpoints: list[str],
        names: dict[str, str] | None = None,
    ):
        self.ctx, self.keys = ctx, keys
        self.endpoints = list(endpoints)
        self.named = dict(names or {})  # endpoint -> the member the user said listens there
        self.owners: dict[str, str] = {}  # endpoint -> the member found there
        # endpoint -> names still to try; (endpoint, name) -> (socket, monitor) being tried
        self._queue: dict[str, list[str]] = {}
        self._probes: dict[tuple[str, str], tuple[zmq.Socket, zmq.Socket]] = {}
        self._verdicts: dict[str, str | None] = {}
        self._hang_ups: dict[tuple[str, str], int] = {}
        self._last: dict[str, dict] = {}  # endpoint -> its last failed probe's event
        self._lock = threading.Lock()  # the joiner's thread and the heartbeat both poll
        for endpoint in self.endpoints:
            if keys is None:
                self._queue[endpoint] = [""]
            elif endpoint in self.named:
                self._queue[endpoint] = [self.named[endpoint]]
            else:  # every member's key, this peer's own last
                names = keys.allow.names()
                self._queue[endpoint] = sorted(names, key=lambda n: n == keys.name)
            self._fill(endpoint)

    def _fill(self, endpoint: str) -> None:
        """Start probes on `endpoint` until PROBES run (or no key is left to try)."""
        queue = self._queue[endpoint]
        while queue and sum(ep == endpoint for ep, _ in self._probes) < self.PROBES:
            name = queue.pop(0)
            server_key = self.keys.key_of(name) if self.keys is not None else None
            if self.keys is not None and server_key is None:
                continue  # no such member (a NAME@ for a key not in allowed/)
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            secure_client(sock, self.keys, server_key)
            monitor = sock.get_monitor_socket(FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(endpoint)
            self._probes[(endpoint, name)] = (sock, monitor)

    def _end(self, endpoint: str, name: str | None = None) -> None:
        """Close one probe (`name`), or all of the endpoint's."""
        for key in [k for k in self._probes if k[0] == endpoint and name in (None, k[1])]:
            sock, monitor = self._probes.pop(key)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _decide(self, endpoint: str, name: str, event: dict) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self.keys is not None:
                self.owners[endpoint] = name
            self._verdicts[endpoint] = None
            self._queue[endpoint] = []
            self._end(endpoint)
            return
        said = _mechanism_mismatch(event) or event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        if hung_up(event) or (self.keys is not None and not said):  # keyed: not this key
            strikes = self._hang_ups.get((endpoint, name), 0) + 1
            self._hang_ups[(endpoint, name)] = strikes
            if strikes < self.HANG_UPS:
                return
            self._last[endpoint] = event
            self._end(endpoint, name)  # not this key (or nobody answers there): the next
            self._fill(endpoint)
            if any(ep == endpoint for ep, _ in self._probes):
                return
        self._verdicts[endpoint] = self._verdict(endpoint, event)
        self._queue[endpoint] = []
        self._end(endpoint)

    def _verdict(self, endpoint: str, event: dict) -> str:
        name = self.named.get(endpoint)
        if self.keys is not None and name and hung_up(event):
            return (
                f"the member at {endpoint} is not {name} (it does not hold {name}'s key) or "
                "runs with another group's key: check the name in --join NAME@tcp://... or "
                "give the address alone"
            )
        return joiner_verdict(event, endpoint, self.keys) or ""

    def poll(self) -> None:
        with self._lock:
            for (endpoint, name), (_, monitor) in list(self._probes.items()):
                while (endpoint, name) in self._probes and monitor.poll(0):
                    self._decide(endpoint, name, recv_monitor_message(monitor))

    def refusal(self) -> str | None:
        self.poll()
        said = [self._verdicts.get(ep, "") for ep in self.endpoints]
        if said and all(said):  # every seed answered, and each refused
            return said[0]
        return None

    def owner(self, endpoint: str) -> str | None:
        """The member found at a seed (keyed groups), or named for it; None: not yet."""
        self.poll()
        return self.owners.get(endpoint) or self.named.get(endpoint)

    def close(self) -> None:
        with self._lock:
            for endpoint in self.endpoints:
                self._end(endpoint)


def refused_everywhere(endpoints: list[str], timeout_s: float = 0.5) -> bool:
    """True when every seed refuses a plain TCP connection: nothing listens on that port
    (a wrong port, or the first peer not started yet), which is not a firewall or a NAT
    (those stay silent). Each probe connects and closes at once, sending nothing."""
    for endpoint in endpoints:
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return False
        except ConnectionRefusedError:
            continue
        except (OSError, ValueError):  # silence, a name that does not resolve, ipc://
            return False
    return bool(endpoints)


def no_member_line(seeds: list[str], waited_s: float, refused: bool) -> str:
    """Why joining gave up: nothing listening at the seeds, or no answer at all. A refusal
    on this machine is a wrong port (or a member not running); elsewhere it may also be a
    home router that forwards no port (some refuse, some stay silent)."""
    where = ", ".join(seeds)
    alone = ("or train without peers: the first peer without --join, a peer's run resumed "
             "alone with --alone")  # fmt: skip
    nat = ("a peer behind a home router (NAT) cannot be joined: join a member others "
           "can reach, forward its port or use a private network (README: Over the "
           "internet)")  # fmt: skip
    if refused and all(is_loopback(seed) for seed in seeds):
        return (
            f"nothing listens at {where} (every connection was refused for "
            f"{waited_s:.0f}s): check the port and that the member runs (its log says "
            f"`listening on tcp://...`); {alone}"
        )
    if refused:
        return (
            f"nothing accepts connections at {where} (every connection was refused for "
            f"{waited_s:.0f}s): check the port and that the member runs; {nat}; {alone}"
        )
    return (
        f"no group member answered at {where} within {waited_s:.0f}s; check the address, "
        f"the firewall and --group-key; {nat}; {alone}"
    )
