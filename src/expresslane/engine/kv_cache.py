"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, reference counts, and a
prefix cache keyed by a hash chain over full blocks. A request's chain starts from its
`cache_salt` (None: the shared root), so requests with different salts never share blocks.

A block whose reference count drops to zero goes back to the free queue but keeps its
contents and hash, so a later request with the same prefix can revive it. Free blocks are
reused least-recently-freed first; when one is reused its hash is forgotten (eviction).

With sliding-window layers in their own pool (`window`, engine/window_blocks.py) a block id
is logical: allocating one takes a window block too, and the window's blocks are given back
as the request moves on (`slide`), whatever the logical block's fate.
"""

from __future__ import annotations

from collections import OrderedDict

from expresslane.engine.request import Request
from expresslane.engine.window_blocks import WindowBlocks


class Block:
    __slots__ = ("id", "ref_count", "hash", "tokens")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.tokens: tuple[int, ...] | None = None


def chain_hash(parent: int | str | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: WindowBlocks | None = None,
    ):
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    @property
    def num_blocks_at_once(self) -> int:
        """The most blocks one request can hold before any go back (the window pool's
        size bounds a request that never slides)."""
        if self.window is None:
            return len(self.blocks)
        return min(len(self.blocks), self.window.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """Extend the request's hash chain to `num_full_blocks` blocks and return it."""
        bs, hashes = self.block_size, req.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(
                chain_hash(
                    hashes[-1] if hashes else req.cache_salt,
                    tuple(req.token_ids[i * bs : (i + 1) * bs]),
                )
            )
        return hashes

    def acquire_prefix(self, req: Request) -> int:
        """For a request with no blocks yet: take the cached blocks that hold a prefix of its
        tokens and return how many tokens they cover. At least one token is always left to
        compute, since the last position's logits are needed. A request that wants its prompt
        tokens' logprobs takes none: it needs the logits of every prompt position."""
        if not self.enable_prefix_caching or req.block_ids:
            return 0
        if req.params.prompt_logprobs is not None:
            return 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[Block] = []
        for i, h in enumerate(self._hashes(req, max_blocks)):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.tokens != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                break  # a hash collision: treat as a miss
            hits.append(block)
        if self.window is not None:
            del hits[self.window.usable_hits([b.id for b in hits]) :]
        for block in hits:
            if block.ref_count == 0:
                del self.free[block.id]
            block.ref_count += 1
            req.block_ids.append(block.id)
        if self.window is not None:
            self.window.take_prefix(req)
        return len(hits) * bs

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = req.num_computed_tokens // bs
        hashes = self._hashes(req, num_full)
        for i in range(num_full):
            block = self.blocks[req.block_ids[i]]
            if block.hash is not None:
                continue
            h = hashes[i]
            if h in self.cached:
                continue  # identical content already cached in another block
            block.hash = h
            block.tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = block.id

    def drop_cached_prefixes(self) -> None:
        """Forget the contents of every free block (after a device fault, a cached block's
        contents are not trusted); blocks that requests hold keep theirs."""
        for block_id in list(self.cached.values()):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._evict(block)

    def _evict(self, block: Block) -> None:
        """Forget a free block's contents (and the window block the cache kept for it)."""
        del self.cached[block.hash]
        block.hash = block.tokens = None
        if self.window is not None:
            self.window.forget(block.id)

    def reset(self) -> None:
        """Every block free and nothing cached (when no request holds blocks any more)."""
        for block in self.blocks:
            block.ref_count = 0
            block.hash = block.tokens = None
        self.free = OrderedDict((i, None) for i in range(len(self.blocks)))
        self.cached = {}
        if self.window is not None:
            self.window.reset()

    # -- allocation ---------------------------------------------------------------------

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(req.block_ids) <= self._num_free_both()

    def has_free(self, num_blocks: int) -> bool:
        """Whether `num_blocks` new blocks fit (in the window pool too, with one)."""
        return num_blocks <= self._num_free_both()

    def _num_free_both(self) -> int:
        """Free blocks in the logical pool and, with one, the window pool."""
        if self.window is None:
            return len(self.free)
        return min(len(self.free), self.window.num_free)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens; False if out of blocks."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self._num_free_both():
            return False
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                self._evict(block)
            block.ref_count = 1
            req.block_ids.append(block_id)
            if self.window is not None:
                self.window.hold(block_id)
        return True

    def release(self, req: Request) -> None:
        """Drop the request's references. Blocks with no cached content are reused first;
        cached ones queue up tail before head, so shared prefixes outlive private tails."""
        if self.window is not None:
            self.window.release(req, lambda b: self.blocks[b].hash is not None)
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        req.block_ids = []

    def trim(self, req: Request, num_tokens: int) -> None:
        """Shrink the block table to `num_tokens` tokens (rolls back rejected speculation)."""
        keep = self.blocks_needed(num_tokens)
        if self.window is not None:
            self.window.trim(req, keep)
        tail = req.block_ids[keep:]
        del req.block_ids[keep:]
        del req.block_hashes[num_tokens // self.block_size :]
        for block_id in reversed(tail):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)

    def slide(self, req: Request) -> None:
        """Give back the window-layer blocks the request's window has passed."""
        if self.window is not None:
            self.window.slide(req)
