"""A rank's `LlamaModel` made tensor-parallel by hooks on its modules, so that the model's
own forward pass runs unchanged on every rank (as vLLM's parallel linears do in theirs):

- vocabulary-parallel embedding: token ids outside the rank's part look up its zero row (the
  last), and the first layer's input is all-reduced;
- row-parallel output projections (attention `o`, MLP `down`, or the whole mixture of
  experts, each expert split as an MLP is): their partial sums all-reduced; FP4 ones split by
  output rows instead (`models/shard.gathered`): input and output all-gathered;
- vocabulary-parallel head: each rank's logits gathered to rank 0, cut to the vocabulary.

The C++ layer stack has no all-reduce: a tensor-parallel model runs the Python layers."""

from __future__ import annotations

from collections.abc import Callable

from expresslane.engine.parallel.collectives import Collectives
from expresslane.models.llama import LlamaModel
from expresslane.models.shard import Shard
from expresslane.quant.linear import Fp4Linear


def parallelize(
    model: LlamaModel, comm: Collectives, shard: Shard, vocab_size: int, before: Callable | None
) -> None:
    """Install the collectives on `model` (rank `shard.rank`). `before(args)` runs first in
    every forward pass, with its arguments (rank 0 sends them to the other ranks there)."""
    first, end, _ = shard.vocab_rows(vocab_size)

    def local_ids(module, args, kwargs):
        if before is not None:
            before(args, kwargs)
        ids, *rest = args
        local = ids - first
        outside = (local < 0) | (local >= end - first)
        return (local.masked_fill(outside, end - first), *rest), kwargs

    def reduce_input(module, args):
        x, *rest = args
        return (comm.all_reduce(x), *rest)

    def reduce_output(module, args, out):
        return comm.all_reduce(out)

    def gather_input(module, args):
        x, *rest = args
        return (comm.all_gather(x), *rest)

    def gather_output(module, args, out):
        return comm.all_gather(out)

    def gather_logits(module, args, out):
        logits = comm.gather(out)
        return out if logits is None else logits[:, :vocab_size].contiguous()

    model.register_forward_pre_hook(local_ids, with_kwargs=True)
    model.layers[0].register_forward_pre_hook(reduce_input)
    for layer in model.layers:
        for module in (layer.o, layer.down if layer.moe is None else layer.moe):
            if isinstance(module, Fp4Linear):  # split by output rows (models/shard.py)
                module.register_forward_pre_hook(gather_input)
                module.register_forward_hook(gather_output)
            else:
                module.register_forward_hook(reduce_output)
    model.lm_head.register_forward_hook(gather_logits)
