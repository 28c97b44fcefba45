"""Suffix proposer (SuffixDecoding, Oliaro et al. 2024; vLLM's `method: "suffix"`): guesses
from what followed the current context before, in the request's own tokens (prompt and output
so far) and in the outputs of its owner's recent finished requests. Agent traffic repeats
itself (the same tool-call shapes, JSON keys and file excerpts, turn after turn), which a
lookup inside one request cannot see across requests.

A guess follows the longest matched context: up to `max_n` tokens through the index, and
where all `max_n` match, as far further back as its occurrences match (16, 32 or 64 tokens:
`DEEPER`), keeping the occurrences that match deepest, as a suffix tree's deeper node would
(a session that repeats an earlier one follows that one, not a third that shares only the
last words). The deeper match of the two indexes wins, the request's own on a tie (its own
copy is the better bet). Then the continuation most of those occurrences took, token by
token, while at least `min_prob` of them agree on the whole path so far: a context always
followed by the same thing yields a long guess, one followed by many things a short one or
none. The planner then cuts it to what the proposal's kind is measured to be worth (`kind`:
the matched depth, positive in the request's own tokens, negative in the cache).

The cache is per owner, the request's prefix-cache salt (the server folds the API key's owner
into it): one key's outputs never shape another key's guesses, unless `share_across_keys`.
It holds each finished request's output with the `max_n` prompt tokens before it (prompts of
multi-turn sessions resend the conversation, which the request's own index already covers),
at most `cache_tokens` tokens in all, oldest out first (suffix_cache.py).

A request's own index grows with its new tokens only; a session's next turn, whose prompt is
the last turn's tokens and a new message, takes that turn's index over (same owner only).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from expresslane.engine.speculation.proposal import Proposal
from expresslane.engine.speculation.suffix_cache import SuffixCache
from expresslane.engine.speculation.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from expresslane.engine.request import Request

MAX_MATCHES = 32  # occurrences of a context a guess is drawn from, newest first
# Context lengths past max_n that a full-length match's occurrences are checked against,
# further back (suffix.py `guess`): a deeper match is the likelier to go on.
DEEPER = (16, 32, 64)
# Finished requests' own indexes kept for the next turn of their session, whose prompt is
# their tokens plus a new message: it takes one over instead of indexing the whole
# conversation again.
RECENT_INDEXES = 8


@dataclass
class _Tracked:
    request: Request  # its tokens, as they are when it leaves, go to the cache
    index: SuffixIndex  # over its own tokens


class SuffixProposer:
    free = True  # a lookup costs next to nothing: the engine asks for the most guesses

    def __init__(
        self,
        min_n: int = 1,
        max_n: int = 8,
        cache_tokens: int = 65536,
        min_prob: float = 0.1,
        share_across_keys: bool = False,
    ):
        self.min_n, self.max_n = min_n, max_n
        self.min_prob = min_prob
        self.share_across_keys = share_across_keys
        self.cache = SuffixCache(cache_tokens, min_n, max_n)
        self.tracked: dict[str, _Tracked] = {}
        self.recent: deque[tuple[Hashable, SuffixIndex]] = deque(maxlen=RECENT_INDEXES)

    @classmethod
    def from_settings(cls, spec: dict) -> SuffixProposer:
        """From a `speculative` table with `method = "suffix"`."""
        from expresslane.errors import InvalidRequestError

        min_n, max_n = int(spec.get("min_n", 1)), int(spec.get("max_n", 8))
        cache_tokens = int(spec.get("cache_tokens", 65536))
        min_prob = float(spec.get("min_prob", 0.1))
        if not 1 <= min_n <= max_n:
            raise InvalidRequestError("speculative min_n and max_n: 1 <= min_n <= max_n")
        if cache_tokens < 0:
            raise InvalidRequestError("speculative cache_tokens must be at least 0")
        if not 0.0 < min_prob <= 1.0:
            raise InvalidRequestError("speculative min_prob must be in (0, 1]")
        share = bool(spec.get("share_across_keys", False))
        return cls(min_n, max_n, cache_tokens, min_prob, share)

    def owner(self, req: Request) -> Hashable:
        return None if self.share_across_keys else req.cache_salt

    def propose(self, requests: list[Request], lengths: list[int]) -> list[Proposal]:
        return [
            self.guess(r.token_ids, k, self._own_index(r), self.cache.index(self.owner(r)))
            for r, k in zip(requests, lengths, strict=True)
        ]

    def release(self, request_id: str) -> None:
        """Forget the request's own index; its output joins its owner's cache."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            return
        req, owner = tracked.request, self.owner(tracked.request)
        if req.num_output_tokens > 0:
            start = max(req.num_prompt_tokens - self.max_n, 0)
            self.cache.add(owner, req.token_ids[start:])
        if _extends(req.token_ids, tracked.index.tokens):
            self.recent.append((owner, tracked.index))

    def _own_index(self, req: Request) -> SuffixIndex:
        """The request's index, brought up to its tokens (only the new ones are indexed)."""
        tracked = self.tracked.get(req.request_id)
        tokens = req.token_ids
        if tracked is None or not _extends(tokens, tracked.index.tokens):
            tracked = _Tracked(req, self._take_recent(req))
            self.tracked[req.request_id] = tracked
        index = tracked.index
        index.extend(tokens[len(index.tokens) :])
        return index

    def _take_recent(self, req: Request) -> SuffixIndex:
        """A new request's index: the recent one of its owner that shares the longest prefix
        with it, cut to that prefix, when that keeps more than it cuts; else an empty one."""
        owner, tokens = self.owner(req), req.token_ids
        best, best_shared = None, 0
        for i, (o, index) in enumerate(self.recent):
            if o == owner:
                shared = _shared_prefix(index.tokens, tokens)
                if shared > best_shared and shared > len(index.tokens) - shared:
                    best, best_shared = i, shared
        if best is None:
            return SuffixIndex(self.min_n, self.max_n)
        _, index = self.recent[best]
        del self.recent[best]
        index.truncate(best_shared)
        return index

    def guess(
        self, context: list[int], k: int, own: SuffixIndex, cached: SuffixIndex | None
    ) -> Proposal:
        """Up to k guesses after `context`: from the deeper match of the two indexes, the
        request's own on a tie. (Ranking a tie by expected tokens let the cache's many
        occurrences of a one-token context, where past outputs repeat a phrase, outvote the
        request's own copy: on recorded SmolLM2 agent sessions, half the steps where n-gram
        kept more tokens than suffix.)"""
        best, best_rank = Proposal(), (0, 0)
        for sign, index in ((1, own), (-1, cached)):
            if index is None:
                continue
            n, starts = index.match(context, MAX_MATCHES)
            if not starts:
                continue
            depth = n
            if n == self.max_n:  # how much further back do the occurrences match?
                depths = [index.depth(context, s, n, DEEPER) for s in starts]
                depth = max(depths)
                starts = [s for s, d in zip(starts, depths, strict=True) if d == depth]
            runs = [index.continuation(s + n, k) for s in starts]
            path, _ = follow(runs, k, self.min_prob)
            rank = (depth, sign)
            if path and rank > best_rank:
                best, best_rank = Proposal(path, kind=sign * depth), rank
        return best


def follow(runs: list[list[int]], k: int, min_prob: float) -> tuple[list[int], float]:
    """The path most of `runs` (what followed each occurrence of the context) take, up to k
    tokens, extended while at least `min_prob` of all the runs agree on it whole; and its
    expected length (the sum of each prefix's share of the runs: the tokens a verification
    keeps on average, if the runs are what comes next). Ties go to the earlier run (newer)."""
    if len(runs) == 1:
        return runs[0][:k], float(min(len(runs[0]), k))
    total, path, expected = len(runs), [], 0.0
    for j in range(k):
        column = [run[j] for run in runs if len(run) > j]
        if not column:
            break
        token, count = column[0], column.count(column[0])
        if count < len(column):  # they part here: the most frequent (most_common: the first)
            token, count = Counter(column).most_common(1)[0]
        if count < min_prob * total:
            break
        path.append(token)
        expected += count / total
        if count < len(runs):
            runs = [run for run in runs if len(run) > j and run[j] == token]
    return path, expected


def _shared_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix (by bisection on slice equality, in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _extends(tokens: list[int], indexed: list[int]) -> bool:
    """Whether `tokens` continue the sequence an index was built on (guesses never enter it;
    a proposer that raised mid-way may have left it behind, which extending catches up)."""
    n = len(indexed)
    return len(tokens) >= n and (n == 0 or tokens[n - 1] == indexed[-1])
