"""The wire: what crosses the network between peers and how.

wire.py (message layout, validation), codecs.py (tensor encodings), keys.py (CURVE keys,
ZAP allow-list), shaping.py (emulated links for tests and benchmarks), transport.py (ZeroMQ
sockets). Above it, atom/gossip/ decides whom to talk to and what an exchange does to the
weights; below it nothing of atom but the config.
"""
