"""Group keys: CURVE (zmq.auth), so that only allow-listed peers reach the averager and
every member is reached only as itself.

The scheme (`atom keygen DIR --peers alice,bob,carol`):

    DIR/group.key, group.key_secret   the group's keypair: its public half names the group
                                      (the `group` field of every header)
    DIR/allowed/NAME.key              each peer's own public key: the allow-list
    DIR/NAME/                         the bundle to copy to peer NAME's machine:
        group.key_secret, NAME.key_secret (its own keypair), allowed/ (all public keys)

Both ends of every connection are a member's own key. A member's server (its ROUTER)
serves with its own keypair, and a peer that dials a member it knows by name sets that
name's public key (allowed/NAME.key) as the server key: only the holder of NAME's secret
completes the handshake, so whatever answers on that connection is NAME (client.py also
refuses a reply whose `from` is another name). A name with no key in allowed/ is never
dialled. A connection is accepted only when the client proves it holds a secret key
whose public half is in allowed/ (ZAP, checked by ThreadAuthenticator before any message
is delivered); the authenticator names each connection by its key's file name (ZAP
User-Id), so a member speaks only as itself: the server refuses a message whose sender
field is another name (transport.py).

A joiner given a seed's address alone (`--join tcp://HOST:PORT`) does not know whose key
to dial it with: it tries the allow-listed keys until one completes the handshake
(handshake.SeedWatch); `--join NAME@tcp://HOST:PORT` says it. Adding a peer later (`atom
keygen DIR --peers dave`) writes dave's bundle and his public key into every bundle's
allowed/; running peers re-read allowed/ when it changes. To revoke a peer, delete its key
from allowed/ everywhere: nobody then accepts its connections nor dials it (the group
keypair serves no connection: a revoked member's copy of it opens nothing).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from atom.config import ConfigError

log = logging.getLogger(__name__)

GROUP = "group"


@dataclass(frozen=True)
class GroupKeys:
    name: str  # this peer's name (its key file's stem)
    group_public: bytes
    group_secret: bytes
    public: bytes
    secret: bytes
    allowed_dir: Path
    # name <-> public key, re-read when allowed/ changes (ZAP's check, and whose key to dial)
    allow: AllowList = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow", AllowList(self.allowed_dir))

    def key_of(self, name: str) -> bytes | None:
        """The public key a member called `name` serves with (None: not allow-listed)."""
        return self.allow.key_of(name)

    @property
    def group_id(self) -> str:
        return "key:" + hashlib.sha256(self.group_public).hexdigest()[:16]


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def keygen(out: Path, names: list[str]) -> list[Path]:
    """Create (or extend) a group in `out`; returns the new peers' bundle directories."""
    out = Path(out)
    bad = [n for n in names if n == GROUP or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", n)]
    if bad or not names:
        raise ConfigError(f"peer names are 1-64 of A-Z a-z 0-9 _ - (not 'group'); got {bad}")
    if len(set(names)) != len(names):
        raise ConfigError("peer names must be unique")
    allowed = out / "allowed"
    for name in names:
        if (allowed / f"{name}.key").exists():
            raise ConfigError(f"peer {name!r} already exists in {out}; choose another name")
    allowed.mkdir(parents=True, exist_ok=True)
    if not (out / f"{GROUP}.key_secret").exists():
        _, secret = zmq.auth.create_certificates(str(out), GROUP)
        _private(Path(secret))
    secrets = out / "secrets"
    secrets.mkdir(exist_ok=True)
    for name in names:
        public, secret = zmq.auth.create_certificates(str(secrets), name)
        _private(Path(secret))
        shutil.copy(public, allowed / f"{name}.key")
    bundles = []
    for entry in sorted(p for p in out.iterdir() if p.is_dir() and (p / "allowed").is_dir()):
        _copy_allowed(allowed, entry / "allowed")  # existing bundles learn the new keys
    for name in names:
        bundle = out / name
        bundle.mkdir()
        shutil.copy(out / f"{GROUP}.key_secret", bundle / f"{GROUP}.key_secret")
        shutil.copy(secrets / f"{name}.key_secret", bundle / f"{name}.key_secret")
        for f in bundle.glob("*.key_secret"):
            _private(f)
        _copy_allowed(allowed, bundle / "allowed")
        bundles.append(bundle)
    return bundles


def _copy_allowed(src: Path, dst: Path) -> None:
    dst.mkdir(exist_ok=True)
    for key in src.glob("*.key"):
        shutil.copy(key, dst / key.name)


def load_bundle(path: str | Path) -> GroupKeys:
    """Read a bundle made by keygen; ConfigError naming the problem otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"group key {path} is not a directory; make one with `atom keygen`")
    group_file = path / f"{GROUP}.key_secret"
    own = [p for p in path.glob("*.key_secret") if p.name != group_file.name]
    if not group_file.exists() or len(own) != 1 or not (path / "allowed").is_dir():
        raise ConfigError(
            f"{path} is not a peer bundle (want group.key_secret, one NAME.key_secret and "
            "allowed/); pass a DIR/NAME directory made by `atom keygen`"
        )
    try:
        group_public, group_secret = zmq.auth.load_certificate(str(group_file))
        public, secret = zmq.auth.load_certificate(str(own[0]))
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read keys in {path}: {err}") from None
    if not group_secret or not secret:
        raise ConfigError(f"{path}: a key_secret file holds no secret key; re-run atom keygen")
    return GroupKeys(
        name=own[0].name.removesuffix(".key_secret"),
        group_public=group_public,
        group_secret=group_secret,
        public=public,
        secret=secret,
        allowed_dir=path / "allowed",
    )


def check_seed_names(keys: GroupKeys | None, names: dict[str, str]) -> None:
    """--join NAME@ENDPOINT in a keyed group: NAME must be allow-listed (its key dials it)."""
    for endpoint, name in names.items():
        if keys is not None and keys.key_of(name) is None:
            raise ConfigError(
                f"--join {name}@{endpoint}: no key for {name!r} in {keys.allowed_dir}; name "
                "a member of the group, or give the address alone"
            )


class AllowList:
    """allowed/: the members' names and public keys. ZAP's credentials provider (is this
    client's key in it?) and the key to dial a name with. Re-reads the directory when it
    changes (at most once a second) so a new member needs no restart."""

    def __init__(self, allowed_dir: Path, on_denied: Callable[[str], None] | None = None):
        self.dir = allowed_dir
        self.on_denied = on_denied or (lambda key: None)
        self._keys: dict[bytes, str] = {}  # public key -> its file's name (the peer's)
        self._names: dict[str, bytes] = {}  # and back
        self._stamp: tuple = ()
        self._checked = 0.0
        self._lock = threading.Lock()
        self._reload()

    def _reload(self) -> None:
        files = sorted(self.dir.glob("*.key"))
        stamp = tuple((f.name, f.stat().st_mtime_ns) for f in files)
        if stamp == self._stamp:
            return
        keys = {}
        for f in files:
            try:
                public, _ = zmq.auth.load_certificate(str(f))
                keys[public] = f.name.removesuffix(".key")
            except (OSError, ValueError):
                log.warning("skipping unreadable public key %s", f)
        self._keys, self._stamp = keys, stamp
        self._names = {name: key for key, name in keys.items()}

    def _fresh(self) -> None:
        """Re-read allowed/ if a second has passed (called under the lock)."""
        if time.monotonic() - self._checked > 1.0:
            self._checked = time.monotonic()
            self._reload()

    def callback(self, domain: str, key: bytes) -> bool:
        with self._lock:
            self._fresh()
            ok = key in self._keys
        if not ok:
            self.on_denied(key.decode("ascii", "replace"))
        return ok

    def name_of(self, key: bytes) -> str:
        with self._lock:
            return self._keys.get(key, "")

    def key_of(self, name: str) -> bytes | None:
        with self._lock:
            self._fresh()
            return self._names.get(name)

    def names(self) -> list[str]:
        with self._lock:
            self._fresh()
            return sorted(self._names)


class GroupAuthenticator(ThreadAuthenticator):
    """ZAP in a thread; a connection's User-Id is its key's allow-list name. A refused key
    is reported with the address it came from (`address`, read by the allow-list)."""

    def __init__(self, ctx: zmq.Context, allow: AllowList):
        super().__init__(ctx, log=logging.getLogger("atom.gossip.zap"))
        self.allow = allow
        self.address = ""  # of the request being handled (one ZAP thread: one at a time)

    def handle_zap_message(self, msg: list[bytes]):
        # the request's frames: version, id, domain, address, ...; pyzmq's handler is a
        # coroutine in newer releases, a plain method in older ones: return what it returns
        self.address = msg[3].decode("ascii", "replace") if len(msg) > 3 else ""
        return super().handle_zap_message(msg)

    def curve_user_id(self, client_public_key: bytes) -> str:
        # called with the raw 32 bytes; the allow-list (like the ZAP callback) holds z85
        return self.allow.name_of(z85.encode(client_public_key))


def start_authenticator(
    ctx: zmq.Context, keys: GroupKeys, on_denied: Callable[[str, str], None]
) -> ThreadAuthenticator:
    allow = keys.allow
    allow.on_denied = lambda key: on_denied(key, auth.address)
    auth = GroupAuthenticator(ctx, allow)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=allow)
    return auth


def secure_server(sock: zmq.Socket, keys: GroupKeys | None) -> None:
    """A member serves with its own keypair: only a client that dials it by its name's
    public key completes the handshake."""
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: GroupKeys | None, server_key: bytes | None) -> None:
    """Dial as this peer's own key, expecting `server_key` (the member's own public key)
    at the other end: the handshake fails unless that member's secret answers."""
    if keys is not None:
        if server_key is None:
            raise ValueError("a keyed peer dials a member only with that member's key")
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = server_key
