"""Baselines for tools/bench_vs_pipeline.py: synchronous data parallel (DDP over gloo) and
GPipe pipeline parallel (torch.distributed.pipelining over gloo), on atom's model, data and
optimizer, one process per rank. See common.py for the records they write."""
