"""The server's TCP listening socket, made here and handed to libzmq (ZMQ_USE_FD), so that
the kernel itself can refuse new connections from an address: a socket filter (classic
BPF, SO_ATTACH_FILTER, Linux) on a listener sees each connection's first packets (its
SYN, the ACK that would complete it), and one it drops is as if lost: the client's
kernel sends it again after 1 s, then 3 s, 7 s... So an address that floods the server
with connections it never finishes (gate.py) is refused without costing the server a
file descriptor, an accept or an event, and its flooder waits, instead of opening a new
connection each time one of its own is ended (thousands a second on loopback: libzmq
and the gate then spent most of a core on it).

A filter attached to a listener is copied to the connections it accepts at that moment;
a new one attached later leaves them be: the connections already open carry on.

Only for tcp:// endpoints whose host is a literal IP address or *; for others (a host or
interface name, ipc://) and where the filter cannot be attached, libzmq listens by
itself and the gate ends connections past its caps without refusing any.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import socket
import struct
from collections.abc import Iterable

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>
SKF_NET_OFF = -0x100000  # a load relative to the network (IP) header
BACKLOG = 100  # libzmq's own (ZMQ_BACKLOG)
MAX_BANNED = 512  # entries in one program (at most 4,096 instructions)

# classic BPF opcodes (linux/filter.h)
_LD_W_ABS, _LD_B_ABS, _AND_K, _JEQ_K, _JA, _RET_K = 0x20, 0x30, 0x54, 0x15, 0x05, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


def _ins(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def refusing(banned: Iterable[str], closed: bool = False) -> list[bytes]:
    """The program: drop packets from each address in `banned` (an IPv4 address, or an
    IPv6 network as address_key writes it: ADDR/64), or from anyone when `closed`."""
    if closed:
        return [_ins(_RET_K, _DROP)]
    v4, v6 = [], []
    for key in banned:
        if "/" in key:
            v6.append(int(ipaddress.IPv6Network(key).network_address) >> 64)
        else:
            v4.append(int(ipaddress.IPv4Address(key)))
    # each entry drops by itself (its own `ret`): every jump stays short
    four = [_ins(_LD_W_ABS, SKF_NET_OFF + 12)]
    for addr in v4:
        four += [_ins(_JEQ_K, addr, 0, 1), _ins(_RET_K, _DROP)]
    four.append(_ins(_RET_K, _ACCEPT))
    six = []
    for prefix in v6:
        six += [
            _ins(_LD_W_ABS, SKF_NET_OFF + 8),
            _ins(_JEQ_K, prefix >> 32, 0, 3),
            _ins(_LD_W_ABS, SKF_NET_OFF + 12),
            _ins(_JEQ_K, prefix & 0xFFFFFFFF, 0, 1),
            _ins(_RET_K, _DROP),
        ]
    six.append(_ins(_RET_K, _ACCEPT))
    head = [
        _ins(_LD_B_ABS, SKF_NET_OFF),  # the IP version, in the first byte's high half
        _ins(_AND_K, 0xF0),
        _ins(_JEQ_K, 0x60, 0, 1),
        _ins(_JA, len(four)),  # IPv6: past the IPv4 part
    ]
    return head + four + six


def attach(fd: int, program: list[bytes]) -> bool:
    """Attach `program` to the socket at `fd` (replacing its filter); False where the
    system does not allow it."""
    code = ctypes.create_string_buffer(b"".join(program))
    fprog = struct.pack("HL", len(program), ctypes.addressof(code))
    try:
        sk = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        sk.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        return True
    except OSError:
        return False
    finally:
        sk.detach()  # libzmq's descriptor: not ours to close


def open_listener(endpoint: str) -> tuple[int, str] | None:
    """A non-blocking listening socket for tcp://HOST:PORT (HOST an IP address, or * for
    every IPv4 address, as libzmq reads it), for ZMQ_USE_FD: (its descriptor, the
    endpoint it is bound to); None for an endpoint libzmq should bind by itself. Raises
    OSError (the port is taken, no descriptor is free)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "*":
        host = "0.0.0.0"
    try:
        ip = ipaddress.ip_address(host)
        number = 0 if port == "*" else int(port)
    except ValueError:
        return None
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    sk = socket.socket(family, socket.SOCK_STREAM)
    try:
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq does
        if family == socket.AF_INET6:  # libzmq's [::] takes IPv4 too
            with contextlib.suppress(OSError):
                sk.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sk.bind((host, number))
        sk.listen(BACKLOG)
        sk.setblocking(False)
        bound = sk.getsockname()[1]
    except OSError:
        sk.close()
        raise
    where = f"[{host}]" if family == socket.AF_INET6 else host
    return sk.detach(), f"tcp://{where}:{bound}"
