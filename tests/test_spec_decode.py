"""Speculative decoding is lossless: greedy outputs are token-identical with and without it."""

from __future__ import annotations

import pytest

from expresslane import LLM, SamplingParams
from expresslane.errors import InvalidRequestError
from expresslane.spec import (
    NgramProposer,
    Proposal,
    best_length,
    expected_tokens,
    make_proposer,
    proposal_length,
)

from .conftest import random_prompts


def test_ngram_proposer_finds_the_latest_continuation():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert p.lookup([5, 6, 7], 3) == []
    assert p.lookup([4, 4, 4], 5) == [4, 4, 4, 4, 4]  # a loop: its period continues
    assert p.lookup([8, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def _search(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The lookup by brute force: every earlier n-gram, longest suffix first."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        hits = [i for i in range(L - n) if tokens[i : i + n] == tokens[L - n :]]
        if hits:
            start = hits[-1] + n
            guess = tokens[start : start + k]
            while 0 < len(guess) < k:
                guess.append(guess[len(guess) - (L - start)])
            return guess
    return []


def test_ngram_index_grows_with_the_sequence_and_matches_a_full_search():
    import random

    from expresslane.engine.request import Request
    from expresslane.spec.ngram import NgramIndex

    rng = random.Random(0)
    p = NgramProposer()
    for _ in range(200):
        index = NgramIndex(1, 4)
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        for _ in range(30):  # a few tokens accepted per step, over a small alphabet
            k = rng.randrange(1, 8)
            assert p.lookup(tokens, k, index) == _search(tokens, k)
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams(), max_tokens=4)
    assert p.propose([req], [2])[0].token_ids == [3, 1]
    assert "r" in p.indexes
    p.release("r")
    assert not p.indexes


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_outputs_identical_with_ngram_speculation(llama_dir, batch):
    base = random_prompts(batch, 10, 40, seed=21)
    prompts = [p + p[:12] for p in base]  # the prompt repeats itself: n-grams to look up
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32").generate(prompts, params)
    spec_llm = LLM(
        str(llama_dir),
        dtype="float32",
        speculative={"method": "ngram", "num_tokens": 4, "max_batch": None},
    )
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = spec_llm.engine.spec_stats
    assert stats.proposed > 0 and stats.accepted > 0
    assert spec_llm.engine.num_steps < sum(len(o.token_ids) for o in plain) // batch + 20
    kv = spec_llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_speculation_respects_stops_and_small_budgets(llama_dir):
    prompts = [p + p for p in random_prompts(6, 8, 20, seed=5)]
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, min_tokens=min(3, n))
        for n in (1, 2, 5, 17, 30, 64)
    ]
    plain = LLM(str(llama_dir), dtype="float32").generate(prompts, params)
    spec = LLM(
        str(llama_dir),
        dtype="float32",
        speculative={"num_tokens": 6},
        max_num_batched_tokens=20,  # drafts get cut by the token budget
    ).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [len(o.token_ids) for o in spec] == [1, 2, 5, 17, 30, 64]


def test_proposal_length_follows_the_acceptance_rate():
    assert [proposal_length(a, 6) for a in (0.0, 0.3, 0.5, 0.8, 0.9, 0.99)] == [1, 1, 1, 4, 6, 6]
    with pytest.raises(InvalidRequestError, match="unknown speculative setting"):
        make_proposer({"num_tokens": 3, "depth": 2})
    assert make_proposer({}, "cpu").max_batch == 2
    assert make_proposer({"max_batch": None}).max_batch is None


def test_best_length_weighs_expected_tokens_against_step_cost():
    flat = lambda k: 0.004  # noqa: E731 - a small model at batch 1: extra tokens are free
    assert best_length(0.5, 6, flat) == 6
    assert best_length(0.0, 6, flat) == 1  # nothing to gain: the fewest
    per_token = lambda k: 0.004 * (1 + k)  # noqa: E731 - every token costs a full step
    assert best_length(0.5, 6, per_token) == 1
    assert best_length(0.9, 6, per_token) == 1  # 1.9 tokens in 2 steps beats 2.71 in 3
    # 31 others yielding 40 tokens; one more token costs 1/32 of the step: worth more than a
    # guess kept 80% of the time; at 1/320 of the step (memory-bound), guesses pay
    assert best_length(0.8, 6, lambda k: 0.004 * (32 + k) / 32, others=40.0) == 1
    assert best_length(0.8, 6, lambda k: 0.004 * (320 + k) / 320, others=40.0) == 6
    assert best_length(0.1, 6, lambda k: 0.004 * (320 + k) / 320, others=40.0) == 1
    assert expected_tokens(0.5, 2) == 1.75


class _Scripted:
    """Proposes the known greedy continuation (always right) or a shifted one (always wrong),
    and records how many guesses it was asked for."""

    def __init__(self, full: list[int], right: bool):
        self.full = full
        self.right = right
        self.asked: list[int] = []

    def propose(self, requests, lengths):
        (req,), (k,) = requests, lengths
        self.asked.append(k)
        n = req.num_tokens
        guess = self.full[n : n + k]
        return [Proposal(guess if self.right else [(t + 1) % 512 for t in guess])]

    def release(self, request_id):
        pass


@pytest.mark.parametrize("right", [True, False])
def test_guesses_per_request_adapt_to_acceptance(llama_dir, right):
    prompt = random_prompts(1, 10, 11, seed=31)[0]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32").generate(prompt, params)[0].token_ids
    llm = LLM(str(llama_dir), dtype="float32", speculative={"num_tokens": 6})
    scripted = _Scripted(prompt + plain, right)
    llm.engine.proposers[1].proposer = scripted
    assert llm.generate(prompt, params)[0].token_ids == plain
    asked = scripted.asked
    assert asked[0] == 3  # the starting guess: acceptance 0.75
    assert asked[-1] == (6 if right else 1)


def test_speculation_stops_past_the_batch_limit_except_for_ultrafast(llama_dir):
    base = random_prompts(4, 10, 20, seed=32)
    prompts = [p + p for p in base]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32").generate(prompts, params)
    spec = {"num_tokens": 4, "max_batch": 2}
    llm = LLM(str(llama_dir), dtype="float32", speculative=spec)
    outs = llm.generate(prompts, params)  # 4 running at once: past the limit of 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.proposed == 0
    engine = llm.engine
    reqs = [engine.add_request(p, params, lane="ultrafast") for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.lane_spec_stats["ultrafast"].proposed > 0
    assert engine.lane_spec_stats["default"].proposed == 0
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in plain]


def test_speculation_payoff_is_measured_per_batch_size():
    from expresslane.spec.payoff import SpecPayoff

    payoff = SpecPayoff(explore_every=4, settled_explore_every=16, recheck_every=8, min_samples=2)
    # untimed: guess, but every 4th step runs plain to time it
    assert [payoff.speculate(1) for _ in range(8)] == [True, True, True, False] * 2
    assert payoff.pays(1) is None
    for _ in range(2):
        payoff.record(1, True, 0.003, 2)  # 1.5 ms per token with guesses
        payoff.record(1, False, 0.001, 1)  # 1 ms without
    assert payoff.pays(1) is False
    decisions = [payoff.speculate(1) for _ in range(32)]
    assert decisions.count(True) == 4  # only the rechecking steps guess, every 8th
    assert payoff.pays(2) is None  # another batch size, timed on its own
    for _ in range(2):
        payoff.record(4, True, 0.003, 6)
        payoff.record(3, False, 0.004, 4)  # 3 and 4 share a bucket
    assert payoff.pays(4) is True and payoff.pays(3) is True and payoff.pays(5) is None
    assert [payoff.speculate(4) for _ in range(16)].count(False) == 1


def test_lanes_stop_guessing_where_it_does_not_pay_except_ultrafast(llama_dir):
    prompt = random_prompts(1, 10, 11, seed=33)[0]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32").generate(prompt, params)[0].token_ids
    llm = LLM(str(llama_dir), dtype="float32", speculative={"num_tokens": 4, "max_batch": None})
    engine = llm.engine
    scripted = _Scripted(prompt + plain, right=True)
    for spec in engine.proposers.values():  # every lane's
        spec.proposer = scripted
    payoff = engine.spec_payoff
    for _ in range(payoff.min_samples):  # timed: guessing costs ten times what it yields
        payoff.record(1, True, 1.0, 1)
        payoff.record(1, False, 0.1, 1)
    assert llm.generate(prompt, params)[0].token_ids == plain
    # 31 steps: only the rechecking ones guess (the 16th)
    assert len(scripted.asked) == 31 // payoff.recheck_every
    req = engine.add_request(prompt, params, lane="ultrafast")
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == plain
    assert scripted.asked and engine.lane_spec_stats["ultrafast"].accepted > 0
