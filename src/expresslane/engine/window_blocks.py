"""The sliding-window layers' own KV pool (vLLM's hybrid KV cache: a group per layer kind).

A request's block table is logical: a block id addresses the full-attention layers' KV
directly, and the window layers' KV through `remap` (logical block -> window block), the map
their stores read and write through (models/window_kv.py). A logical block gets a window
block when it is allocated, and gives it back once no holder's window reaches it any more:
after a step, a request whose queries start at position c (its computed tokens) needs only
the keys after c - window, so the blocks wholly before that are dropped (`slide`). A running
request so holds at most window / block_size + 1 window blocks, plus those of its step's new
tokens. Unmapped logical blocks point at the block past the pool's (`null`): reads there are
masked, and the decode graphs' padded rows write there.

Holders are counted per logical block: a prefix hit shares window blocks that another request
still holds. A logical block whose window block is gone stays a cached prefix for the full
layers, but a hit is cut before any block its window needs and lacks (`usable_hits`): once
every holder has dropped a window block, no later request is served from it.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from expresslane.engine.request import Request


class WindowBlocks:
    def __init__(self, num_blocks: int, num_logical: int, window: int, block_size: int):
        self.num_blocks = num_blocks
        self.window = window
        self.block_size = block_size
        self.null = num_blocks  # the block past the pool's
        self.free: deque[int] = deque(range(num_blocks))
        # one entry past the logical pool: the decode graphs' padding block
        self.refs = np.zeros(num_logical + 1, dtype=np.int32)
        self.remap = np.full(num_logical + 1, self.null, dtype=np.int64)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def first_needed(self, num_computed: int) -> int:
        """The first block that queries from position `num_computed` on can see."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def hold(self, block_id: int) -> None:
        """One more holder of logical `block_id` (a new block takes a window block)."""
        if self.refs[block_id] == 0:
            self.remap[block_id] = self.free.popleft()
        self.refs[block_id] += 1

    def drop(self, block_id: int) -> None:
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self.free.append(int(self.remap[block_id]))
            self.remap[block_id] = self.null

    def usable_hits(self, hits: list[int]) -> int:
        """How many of the cached blocks `hits` (a prefix) a request can take: the window of
        its first computed position must find every block it reaches still mapped."""
        n = len(hits)
        while n and not self.refs[hits[self.first_needed(n * self.block_size) : n]].all():
            n -= 1
        return n

    def take_prefix(self, req: Request) -> None:
        """Hold the window blocks of a request that has just taken its cached prefix."""
        req.window_start = self.first_needed(len(req.block_ids) * self.block_size)
        for block_id in req.block_ids[req.window_start :]:
            self.hold(block_id)

    def slide(self, req: Request) -> None:
        """Drop the blocks the request's window has left behind."""
        first = min(self.first_needed(req.num_computed_tokens), len(req.block_ids))
        for block_id in req.block_ids[req.window_start : first]:
            self.drop(block_id)
        req.window_start = max(req.window_start, first)

    def trim(self, req: Request, keep: int) -> None:
        """Drop the window blocks of table entries `keep` on (a rollback)."""
        for block_id in req.block_ids[max(keep, req.window_start) :]:
            self.drop(block_id)

    def release(self, req: Request) -> None:
        for block_id in req.block_ids[req.window_start :]:
            self.drop(block_id)
        req.window_start = 0

    def reset(self) -> None:
        self.free = deque(range(self.num_blocks))
        self.refs[:] = 0
        self.remap[:] = self.null


def window_pool(sizing, cfg, block_size: int) -> WindowBlocks | None:
    """The window pool a `KVSizing` (engine/runner.py) asks for, or None."""
    if not sizing.window_blocks:
        return None
    window = max(w for w in cfg.layer_windows if w is not None)
    return WindowBlocks(sizing.window_blocks, sizing.num_blocks, window, block_size)
