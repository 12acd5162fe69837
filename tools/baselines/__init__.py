"""Baselines for tools/bench/vs_pipeline.py: synchronous data parallel (DDP over gloo) and
GPipe pipeline parallel (torch.distributed.pipelining over gloo), on atom's model, data and
optimizer, one process per rank. See common.py for the records they write.

Also the single-card baselines: `torchtune_baseline` (torchtune's full fine-tune rebuilt on
atom's model) and `deepspeed_baseline` (ZeRO-Offload / ZeRO-Infinity configurations)."""
