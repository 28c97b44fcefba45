"""The suffix proposer's memory of finished requests: their token sequences, per owner, in one
`SuffixIndex` per owner, at most `max_tokens` tokens in all. When a new sequence would pass
the limit, the oldest ones go first (whoever owns them), so memory stays bounded and the cache
follows what the traffic does now.

The owner is whatever the caller isolates by (suffix.py: the request's prefix-cache salt, which
the server derives from its API key): one owner's sequences never answer another's lookups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from expresslane.engine.speculation.suffix_index import SEP, SuffixIndex


class SuffixCache:
    def __init__(self, max_tokens: int, min_n: int, max_n: int):
        self.max_tokens = max_tokens
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[Hashable, SuffixIndex] = {}
        self.order: deque[tuple[Hashable, int]] = deque()  # (owner, tokens), oldest first
        self.size = 0  # tokens held, separators included

    def index(self, owner: Hashable) -> SuffixIndex | None:
        return self.indexes.get(owner)

    def add(self, owner: Hashable, tokens: list[int]) -> None:
        """Remember a finished sequence (one longer than the cache keeps its end)."""
        tokens = tokens[max(0, len(tokens) + 1 - self.max_tokens) :] if self.max_tokens > 1 else []
        if not tokens:
            return
        index = self.indexes.get(owner)
        if index is None:
            index = self.indexes[owner] = SuffixIndex(self.min_n, self.max_n)
        index.extend([*tokens, SEP])
        self.order.append((owner, len(tokens) + 1))
        self.size += len(tokens) + 1
        while self.size > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        owner, count = self.order.popleft()
        index = self.indexes[owner]
        index.drop(count)
        self.size -= count
        if not index.tokens:
            del self.indexes[owner]
