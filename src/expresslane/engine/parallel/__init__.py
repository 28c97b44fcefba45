"""Tensor parallelism: one model's layers split over several processes (ranks).

Rank 0 is the engine's own process: it owns scheduling, sampling, grammars and speculation,
and its `ModelRunner` runs the model as at size 1. Each forward pass it runs is sent to the
other ranks first (`group.py`), worker processes (`worker.py`) that run the same forward on
their shard of the weights (`shard.py`) and of the KV cache. The collectives the shards need
(`collectives.py`) are hooked onto the model's modules (`layers.py`): one all-reduce after
the embedding, after each attention's output projection and after each MLP, and the logits
gathered to rank 0.
"""
