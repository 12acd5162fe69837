"""The command-line side of peers: `atom train` flags, `atom keygen`, `atom peers`.

atom/cli/__init__.py calls these hooks, so everything about peers' flags lives here:

    atom train --listen tcp://HOST:PORT [--join tcp://HOST:PORT ...] [--group-key DIR]
               [--insecure]
    atom train --resume RUN --alone             # a peer's run, continued without peers
    atom keygen DIR --peers alice,bob,carol      # CURVE keys: a bundle per peer
    atom peers RUN_DIR [--watch]                 # the group as this peer sees it
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from atom.config import ConfigError


def add_train_args(t: argparse.ArgumentParser) -> None:
    g = t.add_argument_group("peers (gossip averaging; see README)")
    g.add_argument(
        "--listen",
        metavar="tcp://HOST:PORT",
        help="join a peer group: listen here (port 0 picks a free one); same as "
        "--set gossip.listen=...",
    )
    g.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="any member of the group; its parameters and step are copied before the first "
        "step (repeatable); without --listen this peer is a client: it starts every "
        "exchange itself (behind a NAT: see README, Over the internet)",
    )
    g.add_argument(
        "--group-key",
        metavar="DIR",
        help="this peer's key bundle from `atom keygen` (only allow-listed peers connect)",
    )
    g.add_argument(
        "--alone",
        action="store_true",
        help="train without peers: no --listen or --join, nor those a resumed peer's run "
        "saved (continue a peer's run alone once its group is gone)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback address without a group key",
    )


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The peer flags as --set overrides (validated with the rest of the config)."""
    if args.alone:
        if args.listen or args.join:
            raise ConfigError("--alone trains without peers: drop --listen and --join")
        return ["gossip.listen=null", "gossip.join="]  # over the saved ones of a resume
    out = []
    if args.listen:
        out.append(f"gossip.listen={args.listen}")
    if args.join:  # without --listen: a client (nobody can dial it; it dials the members)
        out.append(f"gossip.join={','.join(args.join)}")
    if args.group_key:
        out.append(f"gossip.group_key={args.group_key}")
    if args.insecure:
        out.append("gossip.insecure=true")
    return out


def add_commands(sub) -> None:
    k = sub.add_parser("keygen", help="create CURVE keys for a closed peer group")
    k.add_argument("dir", help="group directory (created; an existing one gains the new peers)")
    k.add_argument(
        "--peers",
        required=True,
        help="comma-separated peer names; each gets DIR/NAME/, its bundle for --group-key",
    )
    p = sub.add_parser("peers", help="show the peer group a running `atom train` sees")
    p.add_argument("run", help="the run directory (--out) of a peer")
    p.add_argument("--watch", type=float, metavar="S", help="refresh every S seconds")


def cmd_keygen(args: argparse.Namespace) -> int:
    from atom.gossip.net.keys import keygen

    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    bundles = keygen(Path(args.dir), names)
    for b in bundles:
        print(f"atom: wrote {b}/ (copy it to {b.name}'s machine; atom train --group-key {b})")
    print(
        f"atom: group key in {args.dir}/group.key_secret; public keys in {args.dir}/allowed/ "
        "(keep the *_secret files private)"
    )
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from atom.gossip.status import STATUS_FILE, format_status, read_status

    path = Path(args.run)
    while True:
        try:
            text = format_status(read_status(path))
        except FileNotFoundError:
            raise ConfigError(
                f"no {STATUS_FILE} in {path}; is `atom train --listen ... --out {path}` running?"
            ) from None
        except (ValueError, KeyError) as err:
            raise ConfigError(f"cannot read {path}/{STATUS_FILE}: {err}") from None
        print(text, flush=True)
        if not args.watch:
            return 0
        time.sleep(max(args.watch, 0.2))
        print()


HANDLERS = {"keygen": cmd_keygen, "peers": cmd_peers}
