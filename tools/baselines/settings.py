"""The shared settings of tools/bench/vs_pipeline.py's runs (model, training, atom-only
keys), read by the runner and by the report, so neither imports the other."""

from __future__ import annotations

MODEL = {
    "model.n_layer": 4, "model.n_head": 4, "model.d_model": 128, "model.seq_len": 64,
    "model.tie_embeddings": "false", "model.vocab_size": 256,
}  # fmt: skip
TRAIN = {
    "train.micro_batch": 8, "train.lr": 1e-3, "train.min_lr": 1e-3, "train.warmup_steps": 10,
    "train.grad_clip": 1.0, "train.device": "cpu", "train.dtype": "fp32",
}  # fmt: skip
ATOM_ONLY = {
    "swap.checkpoint": "false", "train.eval_interval": 0, "train.keep_checkpoints": 10000,
    "gossip.wait_peers": 3, "gossip.join_timeout_s": 120, "gossip.heartbeat_s": 1.0,
    "gossip.dead_after_s": 20, "gossip.timeout_s": 60,
}  # fmt: skip


def overrides() -> list[str]:
    return [f"{k}={v}" for k, v in {**MODEL, **TRAIN}.items()]


# atom's variants in one sweep, gossip settings on top of ATOM_ONLY, each spelled out so
# that a change of defaults does not change what a figure measured: "atom" = the outer
# optimizer (decentralised DiLoCo, H 30, outer lr 1, momentum 0.5, int8 exchanges),
# "atom-avg" = plain fp32 pairwise averaging (the only strategy before 2026-11-25)
ATOM_VARIANTS = {
    "atom": {"gossip.strategy": "diloco", "gossip.diloco_steps": 30, "gossip.outer_lr": 1.0,
             "gossip.outer_momentum": 0.5, "gossip.codec": "int8"},
    "atom-avg": {"gossip.strategy": "gossip", "gossip.codec": "fp32"},
}  # fmt: skip
