"""Speculative decoding is lossless: greedy outputs are token-identical with and without it."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.engine.speculation import (
    NgramProposer,
    Proposal,
    best_length,
    expected_tokens,
    make_proposer,
    proposal_length,
)
from expresslane.errors import InvalidRequestError

from .conftest import random_prompts


def test_ngram_proposer_finds_the_latest_continuation():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == ([7, 1], 3)
    assert p.lookup([5, 6, 7], 3) == ([], 0)
    assert p.lookup([4, 4, 4], 5) == ([4, 4, 4, 4, 4], 2)  # a loop: its period continues
    assert p.lookup([8, 1, 2, 1, 2], 5) == ([1, 2, 1, 2, 1], 2)
    assert p.lookup([3, 5, 1, 5], 2) == ([1, 5], 1)


def _search(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> tuple[list[int], int]:
    """The lookup by brute force: every earlier n-gram, longest suffix first."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        hits = [i for i in range(L - n) if tokens[i : i + n] == tokens[L - n :]]
        if hits:
            start = hits[-1] + n
            guess = tokens[start : start + k]
            while 0 < len(guess) < k:
                guess.append(guess[len(guess) - (L - start)])
            return guess, n
    return [], 0


def test_ngram_index_grows_with_the_sequence_and_matches_a_full_search():
    import random

    from expresslane.engine.request import Request
    from expresslane.engine.speculation.ngram import NgramIndex

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
    proposal = p.propose([req], [2])[0]
    assert (proposal.token_ids, proposal.kind) == ([3, 1], 2)
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
    stats = spec_llm.engine.speculation.stats
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
    assert make_proposer({}, "cpu").max_batch == 4
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

    free = False  # asked for the length the engine chose

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
    llm.engine.speculation.proposers["default"].proposer = scripted
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
    assert llm.engine.speculation.stats.proposed == 0
    engine = llm.engine
    reqs = [engine.add_request(p, params, lane="ultrafast") for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.speculation.lane_stats["ultrafast"].proposed > 0
    assert engine.speculation.lane_stats["default"].proposed == 0
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in plain]


def test_speculation_payoff_is_measured_per_batch_size():
    from expresslane.engine.speculation.payoff import SpecPayoff

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
    for spec in engine.speculation.proposers.values():  # every lane's
        spec.proposer = scripted
    payoff = engine.speculation.payoff
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
    assert scripted.asked and engine.speculation.lane_stats["ultrafast"].accepted > 0


def test_acceptance_is_estimated_per_kind_from_the_lane_to_the_request():
    from expresslane.engine.speculation.acceptance import (
        LANE_START,
        LaneAcceptance,
        Tally,
        guesses_tried,
    )

    assert [guesses_tried(k, 4) for k in range(5)] == [1, 2, 3, 4, 4]  # up to the first miss
    lane = LaneAcceptance()
    mine: dict[int, Tally] = {}
    assert lane.rate(mine, 4) == LANE_START  # nothing verified yet
    for _ in range(40):
        lane.record({}, 4, 8, 8)  # other requests: four-token matches always kept
        lane.record({}, 1, 0, 2)  # one-token matches never
    assert lane.rate(mine, 4) > 0.97 and lane.rate(mine, 1) < 0.05
    for _ in range(60):  # this request's four-token matches keep half
        lane.record(mine, 4, 1, 2)
    own = lane.rate(mine, 4)
    assert 0.5 < own < 0.75  # moved from the lane's ~1 toward its own 0.5
    assert lane.rate({}, 4) < 0.75  # and it is part of the lane's record too


def test_payoff_compares_time_per_token_as_a_ratio_of_sums_that_fades_with_steps():
    from expresslane.engine.speculation.payoff import SpecPayoff

    payoff = SpecPayoff(min_samples=2, weight=0.1)
    for _ in range(4):
        payoff.speculate(1)
        payoff.record(1, True, 0.001, 1)  # a guess missed: 1 ms for one token
        payoff.speculate(1)
        payoff.record(1, True, 0.002, 9)  # all kept: 2 ms for nine
        payoff.speculate(1)
        payoff.record(1, False, 0.0005, 1)  # plain: 0.5 ms per token
    # 3 ms per 10 tokens beats 0.5 ms per token (the mean of the ratios, 0.61 ms, would not)
    assert payoff.pays(1) is True
    bucket = payoff._bucket(1)
    arm = bucket.arms[False]
    for _ in range(100):
        payoff.speculate(1)
    payoff.record(1, False, 0.004, 1)  # after 100 steps untimed, a sample all but replaces it
    assert arm.seconds_per_token > 0.0039


def test_free_proposals_are_cut_to_what_their_kind_is_worth(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", speculative={"num_tokens": 6})
    engine = llm.engine
    spec = engine.speculation.proposers["default"]
    for _ in range(50):
        spec.acceptance.record({}, 3, 0, 6)  # three-token matches: never kept
        spec.acceptance.record({}, 1, 6, 6)  # one-token matches: always
    req = engine.add_request([1, 2, 3, 4, 9, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    engine.step()  # the prompt; its sampled token is set below (the n-gram index never saw it)
    req.token_ids[-1] = 4  # ends in 2, 3, 4: a three-token match
    engine.speculation.planner.propose(engine.scheduler.running)
    assert req.spec.kind == 3 and req.spec.guesses == [9]  # cut to the fewest
    req.token_ids[-1] = 9  # ends in 9: a one-token match
    engine.speculation.planner.propose(engine.scheduler.running)
    assert req.spec.kind == 1 and req.spec.guesses == [2, 3, 9, 2, 3, 9]  # the most


def test_step_cost_line_is_predict_for_a_fixed_batch():
    from expresslane.engine.step_model import StepLatencyModel

    model = StepLatencyModel()
    assert model.cost_line(4, 2048) is None
    for i in range(20):
        model.add_calibration(1 + i % 4, 1 + i % 8, 300 * i, 0.001 + 0.0001 * i)
        model.add_calibration(1 + i % 4, 16 + i, 300 * i, 0.003 + 0.0002 * i)
    model.fit()
    line = model.cost_line(3, 1500)
    for tokens in (1, 5, 8, 9, 30):
        assert line(tokens) == pytest.approx(model.predict(3, tokens, 1500), rel=1e-9)


def test_a_batch_verifies_one_guess_count_cut_or_padded(llama_dir):
    prompts = random_prompts(3, 10, 20, seed=35)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2
    params.append(SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True))
    plain = LLM(str(llama_dir), dtype="float32").generate(prompts[:2], params[:2])
    llm = LLM(str(llama_dir), dtype="float32", speculative={"num_tokens": 4, "max_batch": None})
    engine = llm.engine
    a, b, c = (engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True))
    while not all(r.num_computed_tokens == r.num_tokens - 1 for r in (a, b, c)):
        engine.step()
    vocab = engine.model_config.vocab_size
    a.spec.guesses, b.spec.guesses, c.spec.guesses = [7, 8, 9, 10], [11, 12, 13, 14], [15]
    c.spec.guess_probs = torch.full((1, vocab), 1.0 / vocab)
    planner = engine.speculation.planner
    planner.uniform(engine.scheduler.running, None)  # no step costs yet: the median, 4
    assert a.spec.guesses == [7, 8, 9, 10] and b.spec.guesses == [11, 12, 13, 14]
    assert c.spec.guesses == [15] * 4 and c.spec.padding == 3
    assert (
        c.spec.guess_probs.shape == (4, vocab) and c.spec.guess_probs[1:, 15].tolist() == [1.0] * 3
    )
    b.spec.guesses = []
    c.spec.keep_guesses(2)  # a budget cut drops pads first
    assert c.spec.guesses == [15, 15] and c.spec.padding == 1
    engine.speculation.planner.uniform(engine.scheduler.running, None)  # 4, 0, 2: the median, 2
    assert (a.spec.guesses, b.spec.guesses, c.spec.guesses) == (
        [7, 8],
        [b.token_ids[-1]] * 2,
        [15, 15],
    )
    assert (a.spec.padding, b.spec.padding, c.spec.padding) == (0, 2, 1)
    engine.speculation.payoff.speculate = lambda batch: False  # verify these, propose nothing new
    engine.step()
    stats = engine.speculation.stats
    assert stats.steps == 2 and stats.proposed == 3  # a's two guesses, c's one: pads are not
    while engine.has_unfinished():
        engine.step()
    assert [a.output_token_ids, b.output_token_ids] == [o.token_ids for o in plain]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
