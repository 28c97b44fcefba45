"""Plain decode steps replayed from captured graphs, one per (batch bucket, context bucket).

A decode step (every sequence brings one token, `ModelRunner._prepare_decodes`) is padded up
to a batch-size bucket and its padded context length (`decode_ctx`) up to a context bucket;
the step's inputs are copied into that key's static buffers and the graph captured for the key
is replayed. Its logits are sliced back to the real rows; the sampler runs after, eagerly.

- Batch buckets: 1, 2, 4, then multiples of 8 below `max_batch`, then `max_batch` (vLLM's
  list, ending at the largest batch the scheduler makes, so every decode step fits).
- Context buckets: powers of two from 64 tokens, the last capped at the model's positions.
  At most len(batch buckets) x len(context buckets) graphs (64 sequences and 8192 positions:
  11 x 8), each captured lazily, the first time its key is used: which context lengths a
  server sees depends on its traffic, and capturing every pair at start would cost time and
  graph memory for keys that may never come.
- Padding: the runner allocates one more KV block than the pool hands out; its first slot,
  the pad slot, is where padded rows write their K/V and every position they read. Padded rows
  are token 0 at position 0, with nothing cached (start 0); a real row's context past its own
  length is masked by the attention (`AttentionMetadata.decode_mask`, from its start), so the
  pad slot filling it is never seen. Graphs are captured with every row padded, so capturing
  touches no real sequence's KV.
- What is captured: `LlamaModel.forward` over the Python layers (embedding, rotary tables,
  linears, KV write, the decode attention with its mask, the head). The forward has no host
  syncs there (the mask is built from device tensors; `AttentionMetadata.sequences` with its
  `.cpu()` belongs to the C++ layer stack). Steps the C++ layer stack runs (CPU only: there
  is nothing to capture in one native call) stay eager, as do prefill chunks, mixed steps,
  speculative verifications and batches above the largest bucket. Should a capture fail, the
  error is logged and every later step runs eagerly.

The graph backend is the one seam between devices: on CUDA a `torch.cuda.CUDAGraph` (a
warm-up run on a side stream, then the capture, every graph in one memory pool); elsewhere
`EagerReplay` runs the same callable on the same static buffers, so bucketing, padding and
bookkeeping are the same on a CPU (where `cuda_graphs` is then no faster, only testable).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from expresslane.models.attention import AttentionMetadata

log = logging.getLogger("expresslane.engine")
MIN_CTX = 64  # the smallest context bucket, in tokens


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, the multiples of 8 below `max_batch`, then `max_batch`."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    return small + list(range(8, max_batch, 8)) + [max_batch]


def context_buckets(max_ctx: int) -> list[int]:
    """Powers of two from MIN_CTX below `max_ctx`, then `max_ctx`."""
    out, c = [], MIN_CTX
    while c < max_ctx:
        out.append(c)
        c *= 2
    return out + [max_ctx]


def smallest_at_least(buckets: list[int], n: int) -> int | None:
    """The smallest bucket >= n; None above the largest."""
    return next((b for b in buckets if b >= n), None)


class EagerReplay:
    """No graph: `replay` runs the callable again (on CPU, on the same static buffers)."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self.fn = fn

    def replay(self) -> torch.Tensor:
        return self.fn()


class CudaGraphReplay:
    """The callable captured in a CUDA graph; `replay` returns its static output."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits and Triton compiles, uncaptured
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


@dataclass
class GraphStats:
    captures: int = 0  # graphs captured (one per key)
    replays: int = 0  # decode steps run through a graph
    eager: int = 0  # plain decode steps that fit no bucket (or ran in the layer stack)


class StaticStep:
    """One key's static inputs: a decode step of `batch` rows over `ctx` positions."""

    def __init__(self, batch: int, ctx: int, pad_slot: int, device: torch.device):
        self.batch, self.ctx, self.pad_slot = batch, ctx, pad_slot

        def longs(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.input_ids = longs(batch)
        self.positions = longs(batch)
        self.meta = AttentionMetadata(
            slot_mapping=longs(batch).fill_(pad_slot),
            num_decode_tokens=batch,
            decode_q_len=1,
            decode_batch=batch,
            decode_slots=longs(batch * ctx).fill_(pad_slot),
            decode_ctx=ctx,
            decode_starts=longs(batch),
            decode_prompt_ends=longs(batch),
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Copy a real step's inputs into the first rows; every other row is padding."""
        n, L = meta.decode_batch, meta.decode_ctx
        m = self.meta
        self.input_ids[n:] = 0
        self.positions[n:] = 0
        m.decode_starts[n:] = 0
        m.decode_prompt_ends[n:] = 0
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        m.decode_starts[:n] = meta.decode_starts
        m.decode_prompt_ends[:n] = meta.decode_prompt_ends
        m.slot_mapping.fill_(self.pad_slot)
        m.slot_mapping[:n] = meta.slot_mapping
        slots = m.decode_slots.view(self.batch, self.ctx)
        slots.fill_(self.pad_slot)
        slots[:n, :L] = meta.decode_slots.view(n, L)

    def forward(self, model) -> torch.Tensor:
        """The model over the static inputs (what a graph captures)."""
        self.meta.clear_mask()  # built again inside, from the static starts
        return model(self.input_ids, self.positions, self.meta)


class DecodeGraphs:
    """The runner's decode graphs: `run` a step through one, or return None (run it eagerly)."""

    def __init__(self, model, max_batch: int, max_ctx: int, pad_slot: int):
        """`pad_slot`: the first slot of the KV block kept for padded rows."""
        self.model = model
        self.batch_buckets = batch_buckets(max_batch)
        self.context_buckets = context_buckets(max_ctx)
        self.pad_slot = pad_slot
        self.device = model.device
        self.graphs: dict[tuple[int, int], tuple[StaticStep, EagerReplay | CudaGraphReplay]] = {}
        self.stats = GraphStats()
        self.disabled = False  # set when a capture fails: every step eager from then on
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def key(self, batch: int, ctx: int) -> tuple[int, int] | None:
        """(batch bucket, context bucket) of a decode step; None if it fits none."""
        b = smallest_at_least(self.batch_buckets, batch)
        c = smallest_at_least(self.context_buckets, ctx)
        return None if b is None or c is None else (b, c)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Logits of a plain decode step (one row per sequence) from its key's graph; None
        for a step it does not serve."""
        if logits_rows is not None or meta.prefills or meta.decode_q_len != 1:
            return None
        n = meta.decode_batch
        if n == 0 or n != input_ids.shape[0]:
            return None
        key = self.key(n, meta.decode_ctx)
        if key is None or self.disabled or self.model.plan.uses_stack(n, decode_only=True):
            self.stats.eager += 1
            return None
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(*key)
            except Exception:  # an op the graph cannot hold: serve on, without graphs
                log.exception("capturing the decode graph %s failed: decode steps run eagerly", key)
                self.disabled = True
                self.stats.eager += 1
                return None
        static, graph = entry
        static.fill(input_ids, positions, meta)
        self.stats.replays += 1
        return graph.replay()[:n]

    def _capture(self, batch: int, ctx: int):
        """A key's static inputs and graph, captured with every row padded."""
        static = StaticStep(batch, ctx, self.pad_slot, self.device)
        fn = functools.partial(static.forward, self.model)
        graph = EagerReplay(fn) if self._pool is None else CudaGraphReplay(fn, self._pool)
        self.stats.captures += 1
        return static, graph
