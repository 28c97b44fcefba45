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
still holds. A request that ends leaves the window blocks of its cached full blocks to the
prefix cache (`kept`, one reference, taken back oldest first when the pool runs out, or when
the logical block is evicted), so a next turn that extends its tokens finds its window. A
logical block whose window block is gone stays a cached prefix for the full layers, but a hit
is cut before any block its window needs and lacks (`usable_hits`): a block dropped as the
window moved on is never served again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

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
        # logical blocks whose window block the prefix cache holds (one reference), oldest
        # first, and how many of those nobody else holds (taken back when the pool runs out)
        self.kept: OrderedDict[int, None] = OrderedDict()
        self.evictable = 0

    @property
    def num_free(self) -> int:
        """Window blocks an allocation can take (kept ones nobody else holds included)."""
        return len(self.free) + self.evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def first_needed(self, num_computed: int) -> int:
        """The first block that queries from position `num_computed` on can see."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def hold(self, block_id: int) -> None:
        """One more holder of logical `block_id` (a new block takes a window block)."""
        if self.refs[block_id] == 0:
            self.remap[block_id] = self._take()
        elif self.refs[block_id] == 1 and block_id in self.kept:
            self.evictable -= 1
        self.refs[block_id] += 1

    def _take(self) -> int:
        if not self.free:  # the oldest kept block nobody else holds
            self.forget(next(b for b in self.kept if self.refs[b] == 1))
        return self.free.popleft()

    def drop(self, block_id: int) -> None:
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self.free.append(int(self.remap[block_id]))
            self.remap[block_id] = self.null
        elif self.refs[block_id] == 1 and block_id in self.kept:
            self.evictable += 1

    def forget(self, block_id: int) -> None:
        """The prefix cache lets go of logical `block_id`'s window block (evicted)."""
        if block_id in self.kept:
            del self.kept[block_id]
            self.evictable -= self.refs[block_id] == 1
            self.drop(block_id)

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
        """Drop the blocks the request's window has left behind: behind its last full block's
        end, so that its full blocks stay a prefix that a later request can take whole."""
        bs = self.block_size
        first = min(self.first_needed(req.num_computed_tokens // bs * bs), len(req.block_ids))
        for block_id in req.block_ids[req.window_start : first]:
            self.drop(block_id)
        req.window_start = max(req.window_start, first)

    def trim(self, req: Request, keep: int) -> None:
        """Drop the window blocks of table entries `keep` on (a rollback)."""
        for block_id in req.block_ids[max(keep, req.window_start) :]:
            self.drop(block_id)

    def release(self, req: Request, cached: Callable[[int], bool]) -> None:
        """Drop the request's window blocks; those of `cached` logical blocks (in the prefix
        cache) the cache keeps, for a next turn that extends this request's tokens."""
        for block_id in req.block_ids[req.window_start :]:
            if not cached(block_id) or block_id in self.kept:
                self.drop(block_id)
                continue
            self.kept[block_id] = None  # the request's reference becomes the cache's
            self.evictable += self.refs[block_id] == 1
        req.window_start = 0

    def reset(self) -> None:
        self.free = deque(range(self.num_blocks))
        self.refs[:] = 0
        self.remap[:] = self.null
        self.kept.clear()
        self.evictable = 0


def window_pool(sizing, cfg, block_size: int) -> WindowBlocks | None:
    """The window pool a `KVSizing` (engine/runner.py) asks for, or None."""
    if not sizing.window_blocks:
        return None
    window = max(w for w in cfg.layer_windows if w is not None)
    return WindowBlocks(sizing.window_blocks, sizing.num_blocks, window, block_size)
