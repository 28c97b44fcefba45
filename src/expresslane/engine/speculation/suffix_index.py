"""Where each short context occurs in a token stream, most recent first: the lookup table of the
suffix proposer (suffix.py), over one request's own tokens or an owner's cache of finished
sequences (suffix_cache.py).

For each n in min_n..max_n, the latest start of every n-gram that has a continuation, and for
each start the start of the same n-gram before it: a linked list threaded through the stream,
so the index costs a few entries per token, grows with only the new tokens, and a lookup walks
the occurrences newest first. Starts are absolute, so the stream's front can be dropped (a
cache evicting its oldest sequence) without renumbering the rest.

A stream may hold several sequences, each ended by `SEP`: no indexed n-gram contains one, and
no continuation runs past one.
"""

from __future__ import annotations

from array import array

SEP = -1  # ends a sequence in a stream (token ids are never negative)
NONE = -1  # no earlier occurrence


class SuffixIndex:
    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self.tokens: list[int] = []
        self.base = 0  # the absolute position of tokens[0]
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        # per n, per start from `base` on: the start of the same n-gram before it (NONE: none)
        self.earlier: dict[int, array] = {n: array("q") for n in self.sizes}

    def extend(self, new: list[int]) -> None:
        """Append tokens and index the n-grams they complete: those with a token after them."""
        self.tokens += new
        toks = self.tokens
        for n in self.sizes:
            latest, earlier = self.latest[n], self.earlier[n]
            start, stop = len(earlier), len(toks) - n
            if stop <= start:
                continue
            # the new n-grams, made in C: n shifted slices zipped
            grams = zip(*(toks[start + i : stop + i] for i in range(n)))
            check = SEP in toks[start : stop + n]
            for position, key in enumerate(grams, self.base + start):
                if check and SEP in key:
                    earlier.append(NONE)
                    continue
                earlier.append(latest.get(key, NONE))
                latest[key] = position

    def drop(self, count: int) -> None:
        """Forget the stream's first `count` tokens (whole sequences: the caller's to say)."""
        toks, cut = self.tokens, self.base + count
        for n in self.sizes:
            latest, earlier = self.latest[n], self.earlier[n]
            for j in range(min(count, len(earlier))):
                key = tuple(toks[j : j + n])
                if latest.get(key, cut) < cut:  # every occurrence is dropped
                    del latest[key]
            del earlier[:count]
        del toks[:count]
        self.base = cut

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on (relative to the front), undoing their n-grams
        newest first: each n-gram's latest start goes back to the one before it."""
        toks = self.tokens
        for n in self.sizes:
            latest, earlier = self.latest[n], self.earlier[n]
            keep = max(length - n, 0)  # the starts that keep a continuation
            for j in range(len(earlier) - 1, keep - 1, -1):
                key = tuple(toks[j : j + n])
                if SEP in key:
                    continue
                if earlier[j] >= self.base:
                    latest[key] = earlier[j]
                else:
                    del latest[key]
            del earlier[keep:]
        del toks[length:]

    def match(self, context: list[int], limit: int) -> tuple[int, list[int]]:
        """The longest n whose last-n-token context occurs in the stream with a continuation,
        and the starts of up to `limit` of its occurrences, newest first ((0, []): none)."""
        for n in reversed(self.sizes):
            if len(context) < n:
                continue
            start = self.latest[n].get(tuple(context[-n:]), NONE)
            if start < self.base:
                continue
            earlier, starts = self.earlier[n], []
            while start >= self.base and len(starts) < limit:
                starts.append(start)
                start = earlier[start - self.base]
            return n, starts
        return 0, []

    def depth(self, context: list[int], start: int, n: int, lengths: tuple[int, ...]) -> int:
        """How far the occurrence of context's last n tokens at absolute `start` matches the
        context further back: the longest of `lengths` (ascending, each past n) whose last
        tokens it matches in full, else n."""
        end, depth = start - self.base + n, n
        for length in lengths:
            if length > end or length > len(context):
                break
            if self.tokens[end - length : end] != context[-length:]:
                break
            depth = length
        return depth

    def continuation(self, position: int, k: int) -> list[int]:
        """Up to k tokens from absolute `position`, to the end of its sequence. One that runs
        into the end of the stream (a request's own tokens: the context itself) overlaps what
        it predicts: the stream is periodic there, so the period is repeated."""
        j = position - self.base
        out = self.tokens[j : j + k]
        if SEP in out:
            return out[: out.index(SEP)]
        period = len(self.tokens) - j
        while 0 < len(out) < k:
            out.append(out[len(out) - period])
        return out
