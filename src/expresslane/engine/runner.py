"""Turns a scheduled batch into model inputs, runs the forward pass and samples.

Input preparation is plain NumPy over the requests' block tables (cheap at any batch size).
Tokens are ordered: the uniform group first, attended as one padded batch (single-token
decodes, or speculative verifications when every decoding sequence brings the same number of
tokens), then prompt chunks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from expresslane.config import EngineConfig
from expresslane.engine import prompt_logprobs
from expresslane.engine.decode_graphs import DecodeGraphs
from expresslane.engine.grammar import StepMasks
from expresslane.engine.prompt_logprobs import PromptRows
from expresslane.engine.request import Request
from expresslane.engine.sampler import Sampler, SampleResult
from expresslane.errors import InvalidRequestError
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.models.config import ModelConfig
from expresslane.models.kv_store import STORES, store_name
from expresslane.models.llama import LlamaModel
from expresslane.models.window_kv import WindowKV

log = logging.getLogger("expresslane.engine")


def kv_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, store: str = "plain"
) -> int:
    per_token = STORES[store].bytes_per_token(cfg.num_kv_heads, cfg.head_dim, dtype)
    return cfg.num_layers * block_size * per_token


@dataclass(frozen=True)
class KVSizing:
    store: str  # the KV store's name (models/kv_store.py `STORES`)
    bytes_per_token: int  # over every layer
    num_blocks: int  # the (logical) pool: the full-attention layers' blocks
    max_model_len: int  # the context, shrunk to what the blocks hold
    window_blocks: int = 0  # the sliding-window layers' own pool (0: none, they use the above)


def size_kv_cache(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, max_len: int
) -> KVSizing:
    """The KV cache a config asks for a model run in `dtype`: its store, its blocks, and the
    context length they hold (at most `max_len`). Sliding-window layers, where they have a
    pool of their own (`window_layers`), take what the running requests' windows need, at
    most half the memory; the full layers' blocks take the rest."""
    asked = cfg.torch_dtype if config.dtype == "auto" else config.dtype
    store = store_name(config.kv_cache_dtype, asked, dtype)
    bs = config.block_size
    per_layer = kv_bytes_per_block(cfg, bs, dtype, store) // cfg.num_layers
    windowed = len(window_layers(cfg)) if config.tensor_parallel_size == 1 else 0
    full_block, window_block = (cfg.num_layers - windowed) * per_layer, windowed * per_layer
    budget = config.kv_cache_memory_gb * 2**30
    window_blocks = 0
    if windowed:
        reach = -(-max(w for w in cfg.layer_windows if w) // bs) + 2
        step = -(-config.max_num_batched_tokens // bs)
        # at least one request's window and a step's chunk, else none could run
        window_blocks = max(
            min(config.max_batch * reach + step, budget / 2 // window_block), reach + step
        )
        budget = max(budget - window_blocks * window_block, 0)
    num_blocks = config.num_kv_blocks or _full_blocks(budget, full_block, config, max_len)
    window_blocks = int(min(window_blocks, num_blocks))
    if (capacity := num_blocks * bs) < max_len:
        log.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, max_len)
        max_len = capacity
    return KVSizing(store, per_layer * cfg.num_layers // bs, num_blocks, max_len, window_blocks)


def _full_blocks(budget: float, per_block: int, config: EngineConfig, max_len: int) -> int:
    """Blocks of the full-attention layers in `budget` bytes (a model with none: a full
    context for every sequence of a batch; such blocks cost no memory)."""
    if per_block:
        return int(budget // per_block)
    return config.max_batch * -(-max_len // config.block_size)


def window_layers(cfg: ModelConfig) -> list[int]:
    """The sliding-window layers (their KV goes to the window pool)."""
    return [i for i, w in enumerate(cfg.layer_windows or []) if w is not None]


def _make_stores(cfg: ModelConfig, cache: CacheConfig, slots: int, model: LlamaModel):
    """(a KV store per layer, the window layers' block map or None). With a window pool the
    sliding-window layers' stores hold its blocks and one more (the null block, which also
    takes the decode graphs' padded rows) and read through the map."""
    store, dev, dtype = STORES[cache.store], model.device, model.dtype
    stores = []
    windowed = set(window_layers(cfg)) if cache.window_blocks else set()
    remap = None
    if windowed:
        remap = torch.full((cache.num_blocks + 1,), cache.window_blocks, device=dev)
    window_slots = (cache.window_blocks + 1) * cache.block_size
    for i in range(cfg.num_layers):
        n = window_slots if i in windowed else slots
        kv = store(cfg.num_kv_heads, n, cfg.head_dim, dtype, dev)
        stores.append(WindowKV(kv, remap, cache.block_size) if i in windowed else kv)
    return stores, remap


def _uniform_group(items):
    """(uniform group, chunks). The group is every single-token sequence (decodes, prompts
    with one token in this step), or, when there are none and every sequence that is decoding
    brings the same number of tokens (speculative verification), those."""
    singles = [(r, n) for r, n in items if n == 1]
    decoding = [(r, n) for r, n in items if r.num_computed_tokens == r.num_tokens - 1]
    group = singles
    if not singles and decoding and len({n for _, n in decoding}) == 1:
        group = decoding
    members = {id(r) for r, _ in group}
    return group, [(r, n) for r, n in items if id(r) not in members]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache a runner allocates: blocks of `block_size` slots, in the store
    named `store` (models/kv_store.py, STORES)."""

    num_blocks: int
    block_size: int
    store: str = "plain"
    window_blocks: int = 0  # the sliding-window layers' own pool (engine/window_blocks.py)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: CacheConfig,
        seed: int | None = None,
        batch_invariant: bool = False,
        graphs_max_batch: int | None = None,
    ):
        """Bind the model to the KV stores of `cache` (its execution plan follows);
        `batch_invariant` needs a plan that keeps every row's result apart from the batch.
        `graphs_max_batch`: replay plain decode steps of up to this many sequences from
        captured graphs (engine/decode_graphs.py; the cache gets one more block, for padding)."""
        model.batch_invariant = batch_invariant
        self.model = model
        self.cfg = cfg = model.cfg
        self.block_size = cache.block_size
        self.device = model.device
        self.dtype = model.dtype
        pad_block = cache.num_blocks if graphs_max_batch else None  # the block past the pool's
        slots = (cache.num_blocks + (pad_block is not None)) * cache.block_size
        self.kv_caches, self.window_remap = _make_stores(cfg, cache, slots, model)
        self.window_map: np.ndarray | None = None  # the window pool's map, set by the engine
        model.bind_kv_cache(self.kv_caches)
        if batch_invariant and not model.plan.batch_invariant:
            raise InvalidRequestError(
                "batch_invariant needs the C++ layer stack with a row kernel for every linear "
                "(bf16 or FP4 weights on a CPU where the kernels build); this model runs "
                f"{model.plan.describe()}"
            )
        self.sampler = Sampler(self.device, seed)
        self.graphs = None
        if pad_block is not None:
            max_ctx = model.rotary.cos.shape[0]  # the model's positions
            pad_slot = pad_block * cache.block_size
            self.graphs = DecodeGraphs(model, graphs_max_batch, max_ctx, pad_slot)

    def sync_window_map(self) -> None:
        """Copy the window pool's block map to where the window layers read it (before
        every forward pass over the engine's blocks)."""
        if self.window_map is not None:
            self.window_remap.copy_(torch.from_numpy(self.window_map))

    def slots(self, req: Request, start: int, end: int) -> np.ndarray:
        """KV cache slots of positions start..end-1 of `req`, from its block table."""
        pos = np.arange(start, end)
        table = np.asarray(req.block_ids, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, items: list[tuple[Request, int]], prompt_rows: PromptRows | None = None):
        """Order the batch and build (input_ids, positions, metadata, logits rows, samples).

        `samples` lists (request, rows): the request's last known token is sampled, plus one
        row per speculative guess in `req.spec.guesses` (those tokens are scored in the same pass).
        With `prompt_rows`, the logits rows end with the prompt positions whose logprobs
        requests ask for, and `prompt_rows` gets (request, first position, count) for them."""
        q_len = items[0][1] if items else 0
        decoding = (n == q_len and r.num_computed_tokens == r.num_tokens - 1 for r, n in items)
        if items and all(decoding):
            return self._prepare_decodes([r for r, _ in items], q_len)
        decodes, chunks = _uniform_group(items)
        uniform = {id(r) for r, _ in decodes}
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        logits_rows: list[int] = []
        samples: list[tuple[Request, int]] = []
        prefills: list[PrefillChunk] = []
        extra_rows: list[int] = []
        for req, n in decodes + chunks:
            start = req.num_computed_tokens
            end = start + n
            row0 = len(ids)
            tokens = req.token_ids[start:end]
            ids.extend(tokens)
            ids.extend(req.spec.guesses[: n - len(tokens)])
            positions.append(np.arange(start, end))
            slot_parts.append(self.slots(req, start, end))
            if n > 1 and id(req) not in uniform:
                ctx = None
                if start > 0:  # attends to a cached prefix: read it from the paged cache
                    ctx = torch.from_numpy(self.slots(req, 0, end)).to(self.device)
                prefills.append(PrefillChunk(row0, n, end, ctx, req.num_prompt_tokens))
            if end >= req.num_tokens:  # reaches the last known token: sample from there on
                first = row0 + (req.num_tokens - 1 - start)
                logits_rows.extend(range(first, row0 + n))
                samples.append((req, row0 + n - first))
            scored = range(0) if prompt_rows is None else prompt_logprobs.wanted(req, start, end)
            if scored:
                prompt_rows.append((req, scored.start, len(scored)))
                extra_rows.extend(row0 + p - start for p in scored)
        logits_rows.extend(extra_rows)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(self.device),
            prefills=prefills,
        )
        if decodes:
            self._decode_metadata(meta, [r for r, _ in decodes], decodes[0][1])
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.from_numpy(np.concatenate(positions)).to(dev),
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
            samples,
        )

    def _prepare_decodes(self, reqs: list[Request], q_len: int):
        """`prepare` for the most common steps, every sequence decoding its last token and
        the same number of guesses (q_len - 1; none for plain decoding): the slots come from
        the padded table the attention needs anyway, and every row is sampled."""
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
        starts, slots = self._decode_metadata(meta, reqs, q_len)
        positions = starts[:, None] + np.arange(q_len)  # [B, q_len]
        rows = np.arange(len(reqs))[:, None]
        meta.slot_mapping = torch.from_numpy(slots[rows, positions].reshape(-1)).to(dev)
        ids = [t for r in reqs for t in (r.token_ids[-1], *r.spec.guesses[: q_len - 1])]
        ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(positions.reshape(-1)).to(dev)
        return ids, positions, meta, None, [(r, q_len) for r in reqs]

    def padded_slots(self, reqs: list[Request], length: int) -> np.ndarray:
        """[len(reqs), length] slots of positions 0..length-1 of each request (block 0 past
        the end of its block table: masked by the attention)."""
        bs = self.block_size
        nb = -(-length // bs)
        tables = np.zeros((len(reqs), nb), dtype=np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_ids[:nb])] = r.block_ids[:nb]
        pos = np.arange(length)
        return tables[:, pos // bs] * bs + pos % bs

    def _decode_metadata(
        self, meta: AttentionMetadata, reqs: list[Request], q_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fills the decode fields of `meta`; returns (starts [B], padded slots [B, L])."""
        starts = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        L = int(starts.max()) + q_len
        slots = self.padded_slots(reqs, L)
        meta.num_decode_tokens = len(reqs) * q_len
        meta.decode_batch = len(reqs)
        meta.decode_q_len = q_len
        meta.decode_ctx = L
        meta.decode_slots = torch.from_numpy(slots.reshape(-1)).to(self.device)
        meta.decode_starts = torch.from_numpy(starts).to(self.device)
        ends = np.array([r.num_prompt_tokens for r in reqs], dtype=np.int64)
        meta.decode_prompt_ends = torch.from_numpy(ends).to(self.device)
        return starts, slots

    @torch.inference_mode()
    def step(
        self, items: list[tuple[Request, int]], masks: StepMasks | None = None
    ) -> tuple[list[tuple[Request, int]], SampleResult | None]:
        """Run the model on the scheduled items and sample their rows (`masks`: the step's
        grammar masks, on a GPU filled during the forward pass)."""
        prompt_rows: PromptRows = []
        self.sync_window_map()
        input_ids, positions, meta, rows, samples = self.prepare(items, prompt_rows)
        logits = None
        if self.graphs is not None:
            logits = self.graphs.run(input_ids, positions, meta, rows)
        if logits is None:
            logits = self.model(input_ids, positions, meta, rows)
        sampled = sum(n for _, n in samples)
        result = None
        if samples:
            row_reqs = [req for req, n in samples for _ in range(n)]
            offsets = [j for _, n in samples for j in range(n)]
            scores = logits[:sampled] if prompt_rows else logits
            result = self.sampler(scores, row_reqs, offsets, masks)
        if prompt_rows:  # after sampling: a step that raises records nothing
            prompt_logprobs.record(logits[sampled:], prompt_rows)
        return samples, result
