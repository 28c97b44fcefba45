"""The suffix proposer: its index over a request's own tokens and its per-owner cache of finished
outputs, the guesses it draws from them, and (through the engine) lossless verification:
greedy outputs token-identical with suffix, n-gram and no speculation."""

from __future__ import annotations

import random

import pytest

from expresslane import LLM, SamplingParams
from expresslane.engine.request import Request
from expresslane.engine.speculation import SuffixProposer, make_proposer
from expresslane.engine.speculation.suffix import follow
from expresslane.engine.speculation.suffix_cache import SuffixCache
from expresslane.engine.speculation.suffix_index import SEP, SuffixIndex
from expresslane.errors import InvalidRequestError

from .conftest import random_prompts


def _occurrences(stream: list[int], context: list[int], sizes: range, limit: int):
    """SuffixIndex.match by brute force: the longest n-gram ending the context that occurs,
    with a token after it and no separator in it; its starts newest first."""
    for n in reversed(sizes):
        if len(context) < n:
            continue
        gram = context[-n:]
        starts = [
            i for i in range(len(stream) - n) if stream[i : i + n] == gram and SEP not in gram
        ]
        if starts:
            return n, starts[::-1][:limit]
    return 0, []


def _same(a: SuffixIndex, b: SuffixIndex) -> None:
    assert a.tokens == b.tokens and a.base == b.base
    assert a.latest == b.latest and a.earlier == b.earlier


def test_index_grows_incrementally_as_a_full_rebuild_and_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(100):
        grown = SuffixIndex(1, 4)
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        grown.extend(list(tokens))
        for _ in range(20):  # a few tokens at a time, over a small alphabet
            new = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            tokens += new
            grown.extend(new)
            assert grown.match(tokens, 6) == _occurrences(tokens, tokens, range(1, 5), 6)
        whole = SuffixIndex(1, 4)
        whole.extend(tokens)
        _same(grown, whole)
        cut = rng.randrange(len(tokens) + 1)  # cut back, as a next turn takes it over
        grown.truncate(cut)
        prefix = SuffixIndex(1, 4)
        prefix.extend(tokens[:cut])
        _same(grown, prefix)
        grown.extend(tokens[cut:])
        _same(grown, whole)


def test_dropping_the_oldest_sequences_equals_never_having_seen_them():
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(12)]
    index = SuffixIndex(1, 3)
    for s in seqs:
        index.extend([*s, SEP])
    index.drop(sum(len(s) + 1 for s in seqs[:5]))
    fresh = SuffixIndex(1, 3)
    for s in seqs[5:]:
        fresh.extend([*s, SEP])
    assert index.tokens == fresh.tokens
    for n in index.sizes:  # no stale entries left behind
        assert len(index.latest[n]) == len(fresh.latest[n])
    for _ in range(200):
        context = [rng.randrange(4) for _ in range(4)]
        n, starts = index.match(context, 8)
        assert (n, [s - index.base for s in starts]) == fresh.match(context, 8)
        assert n == _occurrences(fresh.tokens, context, range(1, 4), 8)[0]
        for s in starts:  # continuations stop at the end of their sequence
            assert SEP not in index.continuation(s + n, 5)


def test_guesses_follow_the_longest_match():
    p = SuffixProposer(min_n=1, max_n=3)
    own = SuffixIndex(1, 3)
    context = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]  # "3" was followed by 9 and 7, "1 2 3" by 9
    own.extend(context)
    proposal = p.guess(context, 2, own, None)
    assert (proposal.token_ids, proposal.kind) == ([9, 5], 3)
    loop = [4, 4, 4]
    own = SuffixIndex(1, 3)
    own.extend(loop)
    assert p.guess(loop, 5, own, None).token_ids == [4] * 5  # a loop: its period continues
    # the cache's match is longer than the request's own: its guess wins, of kind -n
    cache = SuffixIndex(1, 3)
    cache.extend([2, 3, 8, 8, SEP])
    mine = SuffixIndex(1, 3)
    mine.extend([7, 3, 6, 2, 3])
    proposal = p.guess([7, 3, 6, 2, 3], 4, mine, cache)
    assert (proposal.token_ids, proposal.kind) == ([8, 8], -2)
    # as long as each other: the request's own copy wins, however often the cache saw its own
    cache.extend([2, 3, 8, 8, SEP] * 5)
    mine = SuffixIndex(1, 3)
    mine.extend([2, 3, 5, 7, 2, 3])
    proposal = p.guess([2, 3, 5, 7, 2, 3], 2, mine, cache)
    assert (proposal.token_ids, proposal.kind) == ([5, 7], 2)


def test_a_full_length_match_follows_the_occurrences_that_match_further_back():
    """Of two earlier sequences that share the last max_n tokens, the one that also shares
    the 16 before them is followed, however often the other was seen; the kind says how deep
    the match went."""
    p = SuffixProposer(min_n=1, max_n=4)
    shared, mine = [50, 51, 52, 53], list(range(100, 112))
    cache = SuffixIndex(1, 4)
    cache.extend([*mine, *shared, 7, 7, SEP])  # the request's own history: then 7 7
    for _ in range(3):
        cache.extend([*range(200, 212), *shared, 9, 9, SEP])  # seen more often: then 9 9
    own = SuffixIndex(1, 4)
    context = [*mine, *shared]
    own.extend(context)
    proposal = p.guess(context, 2, own, cache)
    assert (proposal.token_ids, proposal.kind) == ([7, 7], -16)
    index = SuffixIndex(1, 4)
    index.extend([1, 2, 3, 4, 5, 6])
    assert index.depth([9, 2, 3, 4, 5], 1, 4, (16,)) == 4  # fewer than 16 tokens: n


def test_guesses_take_the_most_frequent_continuation_for_as_long_as_it_is_frequent():
    runs = [[5, 6, 7], [5, 6, 1], [5, 6, 7], [5, 2, 2], [9, 9, 9]]
    assert follow(runs, 3, 0.1) == ([5, 6, 7], pytest.approx(0.8 + 0.6 + 0.4))
    assert follow(runs, 3, 0.5) == ([5, 6], pytest.approx(0.8 + 0.6))  # 7: only 2 of 5
    assert follow(runs, 3, 0.9) == ([], 0.0)
    assert follow(runs, 1, 0.1)[0] == [5]  # never past k
    assert follow([[1, 2], [3, 4]], 2, 0.1)[0] == [1, 2]  # a tie: the newer run
    # through the proposer: a context seen 4 times, followed alike 4, 3, 2 and 1 times
    cache = SuffixCache(1000, 1, 2)
    for tail in ([1, 0, 0, 0], [1, 2, 0, 0], [1, 2, 3, 0], [1, 2, 3, 4]):  # ties: the newest
        cache.add(None, [8, 9, *tail])
    own = SuffixIndex(1, 2)
    own.extend([8, 9])
    for min_prob, length in ((0.2, 4), (0.5, 3), (0.6, 2), (0.8, 1)):
        guess = SuffixProposer(1, 2, min_prob=min_prob).guess([8, 9], 6, own, cache.index(None))
        assert guess.token_ids == [1, 2, 3, 4][:length]


def test_cache_holds_at_most_its_size_and_evicts_the_oldest():
    cache = SuffixCache(max_tokens=30, min_n=1, max_n=2)
    for i in range(10):  # 10 sequences of 5 tokens (+ a separator), two owners
        cache.add("a" if i % 2 else "b", [100 + i] * 5)
        assert cache.size <= 30
    held = [t for index in cache.indexes.values() for t in index.tokens if t != SEP]
    assert sorted(set(held)) == [105, 106, 107, 108, 109]  # the five newest
    assert cache.index("b").match([100, 100], 4) == (0, [])
    assert cache.index("b").match([108, 108], 4)[0] == 2
    cache.add("a", list(range(200, 300)))  # longer than the cache: its end is kept
    assert cache.size == 30 and cache.indexes.keys() == {"a"}
    assert cache.index("a").tokens == [*range(271, 300), SEP]
    SuffixCache(0, 1, 2).add(None, [1, 2])  # a cache of size 0 keeps nothing


def _request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0), max_tokens=64, cache_salt=salt)


def _finish(p: SuffixProposer, req: Request, output: list[int]) -> None:
    """A request proposed for once, then finished with `output`."""
    p.propose([req], [4])
    req.token_ids += output
    p.release(req.request_id)


def test_release_frees_the_request_and_its_output_joins_the_cache():
    p = SuffixProposer(min_n=1, max_n=2)
    req = _request("r", [1, 2, 3, 1, 2])
    assert p.propose([req], [3])[0].token_ids == [3, 1, 2]
    assert "r" in p.tracked
    req.token_ids += [7, 7, 7]
    p.propose([req], [3])  # only the new tokens are indexed
    assert p.tracked["r"].index.tokens == req.token_ids
    p.release("r")
    assert not p.tracked
    assert p.cache.index(None).tokens == [1, 2, 7, 7, 7, SEP]  # output + 2 prompt tokens
    p.release("r")  # twice, or a request never proposed for: nothing
    nxt = _request("s", [5, 1, 2])
    assert p.propose([nxt], [4])[0].token_ids == [7, 7, 7]  # learned from the first


def test_a_sessions_next_turn_takes_over_its_previous_turns_index():
    p = SuffixProposer(min_n=1, max_n=3)
    rng = random.Random(3)
    first = _request("t1", [rng.randrange(30) for _ in range(40)], "a")
    _finish(p, first, [rng.randrange(30) for _ in range(10)])
    kept = p.recent[-1][1]
    # the conversation so far, its last token tokenized otherwise, then a new message
    prompt = first.token_ids[:-1] + [rng.randrange(30) for _ in range(8)]
    for owner, taken in (("b", False), ("a", True)):
        nxt = _request(f"t2{owner}", prompt, owner)
        p.propose([nxt], [4])
        index = p.tracked[nxt.request_id].index
        assert (index is kept) is taken  # another owner's is never taken
        fresh = SuffixIndex(1, 3)
        fresh.extend(prompt)
        _same(index, fresh)
    assert all(index is not kept for _, index in p.recent)


def test_one_owners_outputs_never_shape_another_owners_guesses():
    rng = random.Random(2)
    prompts = [[rng.randrange(50) for _ in range(12)] for _ in range(6)]
    outputs = [[rng.randrange(50) for _ in range(20)] for _ in range(6)]

    def b_proposals(p: SuffixProposer) -> list:
        """Owner b's proposals along the outputs owner a had (b asks what a got)."""
        out = []
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            req = _request(f"b{i}", prompt, "b")
            for t in output:
                out.append(p.propose([req], [6])[0])
                req.token_ids.append(t)
            p.release(req.request_id)
        return out

    for share in (False, True):
        p = SuffixProposer(share_across_keys=share)
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            _finish(p, _request(f"a{i}", prompt, "a"), output)
        seen, fresh = b_proposals(p), b_proposals(SuffixProposer(share_across_keys=share))
        assert (seen == fresh) is not share
    assert any(x.kind < 0 for x in seen)  # shared: b's guesses came from a's outputs


def test_settings_are_checked():
    spec = make_proposer({"method": "suffix", "cache_tokens": 100, "max_n": 5, "min_prob": 0.3})
    p = spec.proposer
    assert isinstance(p, SuffixProposer) and p.free
    assert (p.cache.max_tokens, p.max_n, p.min_prob, p.share_across_keys) == (100, 5, 0.3, False)
    for bad in ({"min_prob": 0}, {"min_n": 3, "max_n": 2}, {"cache_tokens": -1}):
        with pytest.raises(InvalidRequestError):
            make_proposer({"method": "suffix", **bad})
    with pytest.raises(InvalidRequestError, match="suffix"):
        make_proposer({"method": "suffixes"})


def _cache_kept(llm: LLM) -> float:
    """Guesses kept that came from the cache (kinds < 0), over the lane's record."""
    tallies = llm.engine.speculation.proposers["default"].acceptance.tallies
    return sum(t.kept for kind, t in tallies.items() if kind < 0)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_outputs_identical_with_suffix_ngram_and_no_speculation(llama_dir, batch):
    """Two rounds: prompts that repeat themselves, then prompts that end a few tokens into the
    first round's outputs, whose outputs repeat the rest (the cache's guesses). The prefix
    cache serves the second round's prompts."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = [p + p[:12] for p in random_prompts(batch, 10, 40, seed=22)]
    modes = {
        "none": None,
        "ngram": {"method": "ngram", "num_tokens": 4, "max_batch": None},
        "suffix": {"method": "suffix", "num_tokens": 4, "max_batch": None},
    }
    llms = {m: LLM(str(llama_dir), dtype="float32", speculative=s) for m, s in modes.items()}
    outs = {m: [o.token_ids for o in llm.generate(first, params)] for m, llm in llms.items()}
    assert outs["suffix"] == outs["ngram"] == outs["none"]
    second = [p + o[:5] for p, o in zip(first, outs["none"], strict=True)]
    again = {m: [o.token_ids for o in llm.generate(second, params)] for m, llm in llms.items()}
    assert again["suffix"] == again["ngram"] == again["none"]
    suffix = llms["suffix"].engine
    assert suffix.speculation.stats.accepted > 0 and _cache_kept(llms["suffix"]) > 0
    assert suffix.num_steps < llms["none"].engine.num_steps
    assert not suffix.speculation.proposers["default"].proposer.tracked  # all released
    for llm in llms.values():
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_owners_are_kept_apart_through_the_engine_and_the_lane_is_chosen(llama_dir):
    """Owner b asks what owner a asked before: with keys apart, b's guesses are those of an
    engine that never saw a; shared, b's guesses use a's outputs. The suffix proposer serves
    the ultrafast lane, set there alone."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = random_prompts(3, 10, 30, seed=23)

    def run(share: bool, owners: str) -> tuple[list, list]:
        spec = {"method": "suffix", "num_tokens": 4, "adaptive": False, "max_batch": None}
        spec["share_across_keys"] = share
        llm = LLM(str(llama_dir), dtype="float32", lanes={"ultrafast": {"speculative": spec}})
        engine = llm.engine
        proposer = engine.speculation.proposers["ultrafast"].proposer
        assert isinstance(proposer, SuffixProposer)
        assert "default" not in engine.speculation.proposers
        seen: list = []
        propose = proposer.propose
        proposer.propose = lambda reqs, ks: seen.append(out := propose(reqs, ks)) or out
        outputs = []
        for owner in owners:
            for p in prompts:  # one at a time: each step's guesses depend on nothing else
                req = engine.add_request(p, params, lane="ultrafast", cache_salt=owner)
                while engine.has_unfinished():
                    engine.step()
                outputs.append(req.output_token_ids)
            if owner == "a":
                seen.clear()
        return outputs, seen

    for share in (False, True):
        (a_out, b_seen), (b_out, b_fresh) = run(share, "ab"), run(share, "b")
        assert a_out[3:] == a_out[:3] == b_out  # the same prompts, the same outputs
        assert (b_seen == b_fresh) is not share
