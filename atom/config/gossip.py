"""GossipConfig: the `gossip:` section of a run's config.

Gossip is on when `listen` is set (`atom train --listen tcp://HOST:PORT`). Validation is
here (ValueError, turned into one-line errors by atom.config) so that a bad value is
refused before any socket is opened. Part of the ground floor with the rest of
atom.config: it imports nothing from atom.
"""

from __future__ import annotations

import ipaddress
import re
import typing
from dataclasses import dataclass
from typing import Literal

from atom.config.choices import check_choices

Strategy = Literal["gossip", "diloco", "noloco"]
Selection = Literal["flow", "random"]
CodecName = Literal["fp32", "bf16", "int8", "topk"]
STRATEGIES, SELECTIONS, CODECS = (typing.get_args(t) for t in (Strategy, Selection, CodecName))

_TCP = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.*-]+):(\d{1,5}|\*)$")


def check_endpoint(endpoint: str, what: str) -> str:
    """tcp://HOST:PORT (port 0 or * = any free port) or ipc://PATH; returns it stripped."""
    endpoint = endpoint.strip()
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    m = _TCP.match(endpoint)
    if not m or (m.group(2) != "*" and int(m.group(2)) > 65535):
        raise ValueError(f"{what} must look like tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    return endpoint


_PORT = re.compile(r"^[1-9][0-9]{0,4}$")
_SEED_NAME = re.compile(r"^([A-Za-z0-9_-]{1,64})@(.+)$")


def wire_endpoint(endpoint: str) -> str:
    """An endpoint another peer told us (a header's `ep`, a peer list): only tcp:// with a
    literal IP address (IPv6 in brackets) that names one host, and a port 1-65535, spelt
    one way only (as str(ipaddress) writes it). ipc:// paths, host names (which a peer
    would resolve), wildcards, port 0 and the unspecified, multicast and broadcast
    addresses come only from this peer's own command line or config; ValueError here."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp:// endpoint: {str(endpoint)[:80]!r}")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not _PORT.match(port) or int(port) > 65535:
        raise ValueError(f"port must be 1-65535: {endpoint[:80]!r}")
    v6 = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.IPv6Address(host[1:-1]) if v6 else ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"host must be a literal IP address: {endpoint[:80]!r}") from None
    bad = ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255")
    canonical = f"tcp://[{ip}]:{port}" if v6 else f"tcp://{ip}:{port}"
    if bad or "%" in host or canonical != endpoint:  # a scope id (%eth0), another spelling
        raise ValueError(f"not one host's address: {endpoint[:80]!r}")
    return endpoint


def split_seed(seed: str) -> tuple[str, str]:
    """A --join value: (member name or "", endpoint). NAME@tcp://HOST:PORT names the member
    that listens there (a keyed group then dials it with NAME's key at once; without a
    name a joiner finds the owner by trying the allow-listed keys, handshake.py)."""
    m = _SEED_NAME.match(seed.strip())
    return (m.group(1), m.group(2)) if m else ("", seed.strip())


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (None for ipc://)."""
    if endpoint.startswith("ipc://"):
        return None
    return endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")


def is_loopback(endpoint: str) -> bool:
    """True when only this machine can reach the endpoint (ipc:// or a loopback address)."""
    host = endpoint_host(endpoint)
    return host is None or host in ("localhost", "::1") or host.startswith("127.")


def parse_rates(spec: str) -> dict[str, float]:
    """'NAME_OR_ENDPOINT=MBPS,...' -> {key: Mb/s}; the key is a peer name or endpoint, or
    several joined by '+' to share one bucket (e.g. one uplink to a remote site)."""
    rates: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.rpartition("=")
        try:
            mbps = float(value)
        except ValueError:
            mbps = -1.0
        if not sep or not key or not mbps > 0:
            raise ValueError(
                f"gossip.link_mbps_to entries look like NAME=MBPS or tcp://H:P=MBPS with "
                f"MBPS > 0, got {item!r}"
            )
        rates[key] = mbps
    return rates


@dataclass
class GossipConfig:
    listen: str | None = None  # tcp://HOST:PORT to bind; None = alone, or a client with join
    # comma-separated endpoints of any group members, each optionally NAME@ENDPOINT
    join: str = ""
    group_key: str | None = None  # a bundle directory made by `atom keygen`
    insecure: bool = False  # allow a non-loopback listen address without a group key
    name: str = ""  # peer id; default: the key bundle's name, else host-random
    # each peer draws its own batches and random stream, seeded by train.seed and its name
    # (identical peers averaging each other waste the group); false: train.seed's alone
    own_seed: bool = True
    advertise: str = ""  # endpoint others dial; default: listen (with a wildcard host resolved)
    group: str = "atom"  # name of an open (keyless) group; keyed groups are named by their key
    # gossip (pairwise averaging) | diloco (outer Nesterov step every diloco_steps) |
    # noloco (the same, the pair's disagreement kept out of the momentum). The default
    # and why (14x fewer bytes, as robust to a poisoning member as plain averaging):
    # docs/benchmarks.md "The outer optimizer"
    strategy: Strategy = "diloco"
    selection: Selection = "flow"  # flow (mixing per second) | random (uniform baseline)
    codec: CodecName = "int8"  # int8: blockwise, replies as deltas
    # topk: the largest topk_fraction of a unit's moves since the reference it shares with
    # the partner (atom/gossip/pairref.py), which costs a copy of the model per partner,
    # for at most topk_partners partners (the least recently used dropped)
    topk_fraction: float = 0.05
    topk_partners: int = 4
    interval_s: float = 0.2  # least time between the starts of two exchanges we initiate
    lanes: int = 2  # exchanges we start at once (different partners); 0: only answer others
    timeout_s: float = 10.0  # one exchange (request + reply) must finish within this
    heartbeat_s: float = 1.0  # ping every known peer this often
    dead_after_s: float = 6.0  # no word from a peer for this long: dead (retried later)
    join_timeout_s: float = 30.0  # give up joining (exit 2) when no member answers in time
    pull_state: bool = True  # on join, copy parameters and step from a member first
    wait_peers: int = 0  # before the first step, wait (up to join_timeout_s) for this many others
    diloco_steps: int = 30  # diloco, noloco: inner steps between outer steps of a unit (H)
    # outer Nesterov SGD; unset: 1.0 / 0.5 (atom/gossip/merge.py OUTER_DEFAULTS)
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_consensus: float = 1.0  # noloco: pull towards the pair's mean outer weights
    link_mbps: float = 0.0  # emulate: cap every outgoing link at this rate (0: off)
    link_mbps_to: str = ""  # emulate per link: 'NAME=MBPS,tcp://H:P=MBPS,A+B=MBPS' (A, B share)
    # reject larger messages; 0: 1.25x the largest payload in fp32 (the unit; noloco's
    # twice that) + 1 MiB
    max_message_mb: float = 0.0
    explore: float = 0.1  # flow selection: chance of a uniform random partner
    penalty_s: float = 30.0  # a peer that sent a bad message is not chosen for this long
    # robust merge (atom/gossip/robust.py): a difference beyond max_relative x the unit's
    # own norm is refused; clip_factor clips to, reject_factor refuses beyond, that
    # multiple of the unit's recent median difference (0: off)
    max_relative: float = 2.0
    max_peers: int = 256  # the peer table's bound (fake ids cannot grow it without end)
    # exchange and state requests served per second per sender (bursts of 2 s, at least
    # 64), ten times that per address; 0: no limit (atom/gossip/net/limits.py)
    max_requests_per_s: float = 100.0
    clip_factor: float = 3.0
    # incoming messages left unfinished may hold this much memory (at least 8 of the
    # largest message) before every gossip connection is dropped and the listener
    # reopened (atom/gossip/net/memguard.py); 0: off
    recv_guard_mb: float = 64.0
    reject_factor: float = 0.0
    probe_kb: int = 256  # bandwidth probe sent to each new peer

    def __post_init__(self) -> None:
        if self.listen is not None:
            self.listen = check_endpoint(self.listen, "gossip.listen")
            if self.listen.startswith("ipc://") and not self.advertise:
                raise ValueError(  # its headers' `ep` would be refused by every peer
                    f"gossip.listen {self.listen}: peers dial each other at tcp://IP:PORT "
                    "only; listen on tcp://, or set gossip.advertise=tcp://IP:PORT"
                )
        for seed in self.join.split(","):
            if seed.strip():
                check_endpoint(split_seed(seed)[1], "gossip.join")
        if self.advertise:
            check_endpoint(self.advertise, "gossip.advertise")
            try:  # what others dial: a name or a path there would be refused by every peer
                wire_endpoint(self.advertise)
            except ValueError:
                raise ValueError(
                    f"gossip.advertise must be tcp://IP:PORT with a literal IP address (peers "
                    f"accept no host names or ipc:// from each other), got {self.advertise!r}"
                ) from None
        check_choices(self, "gossip")
        if not 0 < self.topk_fraction <= 0.2:  # above, 5 bytes an entry outweigh int8's 1
            raise ValueError(f"gossip.topk_fraction must be in (0, 0.2], got "
                             f"{self.topk_fraction}")  # fmt: skip
        if self.topk_partners < 1:
            raise ValueError(f"gossip.topk_partners must be >= 1, got {self.topk_partners}")
        for name in ("timeout_s", "heartbeat_s", "dead_after_s", "join_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"gossip.{name} must be > 0, got {getattr(self, name)}")
        if not self.max_relative > 0:
            raise ValueError(f"gossip.max_relative must be > 0, got {self.max_relative}")
        for name in ("interval_s", "link_mbps", "max_message_mb", "penalty_s", "clip_factor",
                     "reject_factor", "max_requests_per_s", "recv_guard_mb"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"gossip.{name} must be >= 0, got {getattr(self, name)}")
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError("gossip.dead_after_s must exceed gossip.heartbeat_s")
        if self.max_peers < 2 or self.wait_peers >= self.max_peers:
            raise ValueError(f"gossip.max_peers must be >= 2 and above gossip.wait_peers, got "
                             f"{self.max_peers}")  # fmt: skip
        if self.wait_peers < 0:
            raise ValueError(f"gossip.wait_peers must be >= 0, got {self.wait_peers}")
        if not 0 <= self.lanes <= 16:
            raise ValueError(f"gossip.lanes must be in [0, 16], got {self.lanes}")
        if self.diloco_steps < 1 or self.probe_kb < 1:
            raise ValueError("gossip.diloco_steps and gossip.probe_kb must be >= 1")
        if not (
            (self.outer_lr is None or 0 < self.outer_lr <= 2)
            and (self.outer_momentum is None or 0 <= self.outer_momentum < 1)
            and 0 <= self.outer_consensus <= 1
        ):
            raise ValueError("need 0 < gossip.outer_lr <= 2, 0 <= gossip.outer_momentum < 1 "
                             "and 0 <= gossip.outer_consensus <= 1")  # fmt: skip
        if not 0 <= self.explore <= 1:
            raise ValueError(f"gossip.explore must be in [0, 1], got {self.explore}")
        if len(self.name) > 64 or not re.fullmatch(r"[A-Za-z0-9_.-]*", self.name):
            raise ValueError("gossip.name: at most 64 of A-Z a-z 0-9 _ . -")
        parse_rates(self.link_mbps_to)
        if (
            self.listen is not None
            and not is_loopback(self.listen)
            and not self.group_key
            and not self.insecure
        ):
            raise ValueError(
                f"listening on {self.listen} (reachable from other machines) needs a group key: "
                "create one with `atom keygen DIR --peers NAMES` and pass --group-key DIR/NAME, "
                "or pass --insecure for a trusted network"
            )

    @property
    def enabled(self) -> bool:
        """Gossip is on with a listen address, or with only a member to join: a client,
        which nobody can dial, starts every exchange itself (atom/gossip/reach.py)."""
        return self.listen is not None or bool(self.seeds)

    @property
    def client(self) -> bool:
        return self.listen is None and bool(self.seeds)

    @property
    def seeds(self) -> list[str]:
        """The members to join through (their endpoints; a NAME@ prefix removed)."""
        return [split_seed(s)[1] for s in self.join.split(",") if s.strip()]

    @property
    def seed_names(self) -> dict[str, str]:
        """endpoint -> member name, for the seeds given as NAME@tcp://HOST:PORT."""
        return {ep: name for name, ep in map(split_seed, self.join.split(",")) if name}
