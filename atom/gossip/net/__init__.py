"""The wire: what crosses the network between peers and how.

wire.py (message layout, validation), codecs.py (tensor encodings), keys.py (CURVE keys,
ZAP allow-list), handshake.py (why a handshake failed, for the joiner and the member),
shaping.py (emulated links for tests and benchmarks), transport.py (the ZeroMQ server),
client.py (the ZeroMQ client), counters.py (counters, rate-limited log lines), limits.py
(per-sender request limits), replay.py (random request ids and the replay window),
memguard.py (memory and open-file bounds on what connections hold). Above it,
atom/gossip/ decides whom to talk to and what an exchange does to the weights; below it
nothing of atom but the config.
"""
