"""Peers: every peer trains a full copy; a background gossip averages the host fp32 master
parameters with chosen partners, one unit at a time, and never blocks a training step.

    net/           the wire (its own __init__ lists its files): message layout, codecs,
                   CURVE keys and handshake verdicts, link shaping, the ZeroMQ client and
                   server, counters, rate limits, the replay window, the memory guard
    membership.py  peer table, peer lists, link measurements
    heartbeat.py   the heartbeat thread: pings, probes, sweeps, goodbye
    selection.py   flow-based (GWTF link cost) and uniform random partner choice
    merge.py       what an exchange does to master weights: pairwise mean or DiLoCo
    robust.py      the robust merge: refuse, clip and down-weight outlying differences
    budget.py      how far requesters may move a unit over time; the collapse alarm
    pairref.py     the reference a pair of peers shares for top-k exchanges
    session.py     one exchange's codec work at either end: encode, decode, the pair's reference
    averager.py    the exchange loop (initiator) and its responder, state pull on join
    peer.py        GossipPeer: wires the above to an engine's shared units; the Trainer's hooks
    status.py      gossip.json status file, the table `atom peers` prints

The gossip config section is atom/config/gossip.py; the CLI's peer flags and commands
are atom/cli/peers.py. This package's __init__ imports nothing.
"""
