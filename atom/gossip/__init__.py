"""Peers: every peer trains a full copy; a background gossip averages the host fp32 master
parameters with chosen partners, one unit at a time, and never blocks a training step.

    settings.py    GossipConfig (the `gossip:` config section)
    wire.py        message header: msgpack, versioned, every field validated
    codecs.py      tensor codecs on the wire: fp32, bf16, blockwise int8, top-k
    keys.py        CURVE group keys (`atom keygen`), allow-list, ZAP authenticator
    shaping.py     per-link token buckets (emulate slow links on one machine)
    transport.py   ZeroMQ ROUTER server and DEALER client, timeouts everywhere
    membership.py  peer table, heartbeats, peer lists, goodbye, link measurements
    selection.py   flow-based (GWTF link cost) and uniform random partner choice
    merge.py       what an exchange does to master weights: pairwise mean or DiLoCo
    pairref.py     the reference a pair of peers shares for top-k exchanges
    averager.py    the exchange loop (initiator) and its responder, state pull on join
    peer.py        GossipPeer: wires the above to a SwapEngine; the Trainer's hooks
    status.py      counters, gossip.json status file, the table `atom peers` prints
    commands.py    CLI hooks: train's --listen/--join/--group-key/--insecure, keygen, peers

This package's __init__ imports nothing: atom.config imports settings.py from here.
"""
