"""What each config key does, one line each: the source of docs/config.md
(`python -m tools.config_reference` writes it from these and the dataclasses' defaults;
tests/test_docs.py fails when a key has no line here or the page is stale)."""

from __future__ import annotations

DESCRIPTIONS: dict[str, str] = {
    # ------------------------------------------------------------------ model
    "model.arch": "`gpt` (learned positions, LayerNorm, GELU, tied head) or `llama` (RMSNorm, "
    "RoPE, SwiGLU, grouped-query attention; also Mistral and Qwen2)",
    "model.n_layer": "transformer blocks",
    "model.n_head": "attention heads; d_model must be divisible by it",
    "model.n_kv_head": "llama: key/value heads (grouped-query attention); null: n_head",
    "model.d_model": "width of the residual stream",
    "model.d_ff": "MLP width; null: 4·d (gpt) or ≈8/3·d rounded to `multiple_of` (llama)",
    "model.vocab_size": "vocabulary; at least the dataset's (256 for byte-level)",
    "model.seq_len": "context length in tokens",
    "model.bias": "gpt: biases in the linear layers and LayerNorms",
    "model.gelu": "gpt: `none` (exact GELU) or `tanh` (GPT-2's approximation)",
    "model.qkv_bias": "llama: biases on the q/k/v projections (Qwen2)",
    "model.tie_embeddings": "tie the head to the embedding; null: true for gpt, false for llama",
    "model.rope_theta": "llama: RoPE base (the 'rotate half' layout)",
    "model.rope_type": "llama: RoPE frequency scaling: `default`, `linear`, `llama3` (Llama "
    "3.1+) or `yarn`; set from a checkpoint's config.json",
    "model.rope_factor": "RoPE scaling factor (1: none)",
    "model.rope_low_freq_factor": "llama3 scaling: low-frequency factor",
    "model.rope_high_freq_factor": "llama3 scaling: high-frequency factor",
    "model.rope_original_max_position": "llama3 / yarn scaling: the context the model was "
    "trained with before scaling",
    "model.rope_beta_fast": "yarn: the ramp's fast end",
    "model.rope_beta_slow": "yarn: the ramp's slow end",
    "model.rope_attention_factor": "yarn: attention scale; null: 0.1 ln(rope_factor) + 1",
    "model.rope_truncate": "yarn: round the ramp's ends to whole dimensions",
    "model.sliding_window": "llama: attend to the last N positions only (Mistral); null: full "
    "causal attention",
    "model.norm_eps": "epsilon of the normalisation layers",
    "model.multiple_of": "llama: d_ff is rounded up to a multiple of this",
    "model.init_std": "standard deviation of the random initialisation",
    "model.init_from": "a Hugging Face checkpoint directory to start from; set by `model: "
    "hf:PATH` or `--model PATH`, which also fill the other model keys from its config.json",
    # ------------------------------------------------------------------ train
    "train.micro_batch": "sequences per micro-batch",
    "train.grad_accum": "micro-batches per optimizer step",
    "train.lr": "peak learning rate (after the linear warm-up)",
    "train.min_lr": "learning rate at the end of the cosine decay",
    "train.warmup_steps": "steps of linear warm-up",
    "train.lr_decay_steps": "steps of cosine decay; null: max_steps",
    "train.max_steps": "optimizer steps of the run (`--max-steps`)",
    "train.weight_decay": "AdamW weight decay",
    "train.beta1": "AdamW beta1",
    "train.beta2": "AdamW beta2",
    "train.grad_clip": "clip the global gradient norm to this; 0: off (updates then overlap "
    "the backward)",
    "train.seed": "seed of the initialisation and of the batches (a resumed run sees the "
    "same batches)",
    "train.compile_blocks": "torch.compile the transformer blocks: `auto` (on CUDA), `on`, "
    "`off`; falls back to eager blocks with a warning where they do not compile",
    "train.device": "`auto` (the GPU if there is one), `cpu`, `cuda` or `cuda:N`",
    "train.dtype": "compute dtype on the device: `auto` (bf16 on a GPU, fp16 with loss "
    "scaling on cards without bf16, fp32 on CPU), `fp32`, `bf16`, `fp16`",
    "train.optimizer": "`adamw` (torch's fused AdamW) or `deepspeed` (DeepSpeedCPUAdam; "
    "`pip install -e '.[deepspeed]'`)",
    "train.eval_interval": "validation loss every N steps (and at the end); 0: only at the end",
    "train.eval_batches": "validation batches per evaluation",
    "train.log_interval": "a log line every N steps when there is no progress bar",
    "train.ckpt_interval": "a checkpoint every N steps (and at the end); 0: only at the end",
    "train.keep_checkpoints": "checkpoints kept in the run directory (the newest)",
    "train.data": "`default` (the Python standard library's source, no download) or a "
    "directory made by `atom prepare`",
    "train.logger": "metrics besides metrics.jsonl (always): comma-separated `csv`, "
    "`tensorboard`, `wandb` (offline unless WANDB_MODE says otherwise)",
    "train.max_abs_weight": "a weight beyond this (or not finite) rolls the run back to its "
    "newest checkpoint instead of being saved",
    # ------------------------------------------------------------------ swap
    "swap.layers_per_unit": "transformer blocks per unit (what is copied to the device at once)",
    "swap.prefetch": "units copied ahead of the one computing; device slots = prefetch + 1",
    "swap.checkpoint": "keep only unit inputs in the forward and recompute in the backward",
    "swap.offload_activations": "with checkpoint: keep those unit inputs in host memory",
    "swap.acts_on_card": "with offload_activations: the inputs of this many block units "
    "nearest the head stay on the device (their backward comes first)",
    "swap.disk_acts": "with offload_activations and disk_dir: units (none, all, or indices "
    "such as 1-20) whose offloaded inputs go to the NVMe tier instead of host RAM",
    "swap.disk_weights": "with disk_dir: card-updated units (none, all, or indices such as "
    "0-20) whose compute copy (the bus copy of the weights) lives on the NVMe tier",
    "swap.order": "with grad_accum > 1: `unit` (each unit runs every micro-batch while "
    "loaded: weights and gradients cross the bus once a step) or `micro` (micro-batch after "
    "micro-batch: less activation memory, more traffic)",
    "swap.update": "`exact` (equals plain PyTorch) or `eager` (units update as their "
    "gradients land, clipped by the previous step's norm)",
    "swap.resident_units": "block units kept on the device all step in extra slots",
    "swap.state": "host state: `fp32` (16 bytes a parameter), `compact` (8: the fp32 "
    "master exactly as bf16 + a 16-bit remainder, 8-bit Adam moments) or `bf16` (6, opt "
    "in: bf16 weights as the master, 8-bit moments, stochastic rounding; not exact)",
    "swap.compile_update": "compact state: update whole chunks with one torch.compile'd "
    "loop (a C++ compiler; ~30 s the first time, cached); falls back to the eager update "
    "with a warning",
    "swap.disk_dir": "the NVMe tier: a directory for master weights and moments, paged "
    "around each unit's update (on the host or the card); null: in RAM",
    "swap.disk_slots": "NVMe tier: units' state held in RAM at once",
    "swap.card_update": "units whose update runs on the device, their state streamed over "
    "the bus: `none`, `all` (every unit not tied to another), or indices such as `1-30`",
    # ------------------------------------------------------------------ gossip
    "gossip.listen": "tcp://HOST:PORT to listen on (`--listen`); null: train alone, or with "
    "gossip.join a client that starts every exchange itself",
    "gossip.join": "comma-separated endpoints of any group members (`--join`)",
    "gossip.group_key": "this peer's key bundle from `atom keygen` (`--group-key`)",
    "gossip.insecure": "allow listening on a non-loopback address without a group key",
    "gossip.name": "peer id; default: the key bundle's name, else a random one",
    "gossip.own_seed": "each peer's data order and torch random stream seeded by `train.seed` "
    "and its name, said in its first lines (peers on the same batches waste the group); "
    "`false`: `train.seed`'s, as a run alone",
    "gossip.advertise": "the endpoint others dial; default: the listen address",
    "gossip.group": "name of an open (keyless) group; a keyed group is named by its key",
    "gossip.strategy": "`diloco` (outer Nesterov step every diloco_steps), `noloco` (the "
    "same, the pair's disagreement kept out of the momentum) or `gossip` (plain averaging)",
    "gossip.selection": "`flow` (partners chosen for mixing per second from measured links) "
    "or `random`",
    "gossip.codec": "`int8` (blockwise), `bf16`, `fp32` or `topk` (the largest moves only, "
    "with error feedback)",
    "gossip.topk_fraction": "topk: the fraction of a unit's entries sent (at most 0.2)",
    "gossip.topk_partners": "topk: partners a reference copy of the model is kept for",
    "gossip.interval_s": "least seconds between the starts of two exchanges this peer starts",
    "gossip.lanes": "exchanges started at once (with different partners); 0: only answer",
    "gossip.timeout_s": "seconds an exchange may take, plus its bytes at the link's measured "
    "speed and 4 round trips",
    "gossip.heartbeat_s": "seconds between pings of every known peer",
    "gossip.dead_after_s": "seconds without word before a peer counts as dead (retried later); "
    "a slow link gets longer: what may queue ahead of a ping (each lane's request and reply) "
    "at its measured speed, and 4 round trips",
    "gossip.join_timeout_s": "give up joining (exit 2) when no member answers within this",
    "gossip.pull_state": "on joining, copy the group's weights and step from a member first",
    "gossip.wait_peers": "before the first step, wait (up to join_timeout_s) for this many others",
    "gossip.diloco_steps": "diloco, noloco: inner steps between two outer steps of a unit (H)",
    "gossip.outer_lr": "outer Nesterov learning rate; null: 1.0",
    "gossip.outer_momentum": "outer Nesterov momentum; null: 0.5",
    "gossip.outer_consensus": "noloco: pull towards the pair's mean outer weights",
    "gossip.link_mbps": "emulate: cap every outgoing link at this many Mb/s; 0: off",
    "gossip.link_mbps_to": "emulate per link: `NAME=MBPS,tcp://H:P=MBPS,A+B=MBPS` (A and B "
    "share one)",
    "gossip.max_message_mb": "refuse larger messages; 0: 1.25x the largest unit in fp32 + 1 MiB",
    "gossip.explore": "flow selection: the chance of a uniformly random partner",
    "gossip.penalty_s": "seconds a peer that sent a bad message is neither chosen nor served",
    "gossip.max_relative": "refuse a difference beyond this many times the unit's own norm",
    "gossip.max_peers": "the peer table's bound",
    "gossip.max_requests_per_s": "requests served per second per sender (ten times that per "
    "address); 0: no limit",
    "gossip.clip_factor": "clip a partner's difference to this many times the other "
    "partners' typical one; 0: off",
    "gossip.recv_guard_mb": "memory unfinished incoming messages may hold (at least 8 of the "
    "largest) before every connection is dropped; 0: off",
    "gossip.reject_factor": "refuse a difference beyond this many times the typical one; 0: off",
    "gossip.probe_kb": "size of the bandwidth probe sent to each new peer",
}
