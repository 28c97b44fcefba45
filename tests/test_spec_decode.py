"""Speculative decoding is lossless: greedy outputs are token-identical with and without it."""

from __future__ import annotations

import pytest

from expresslane import LLM, SamplingParams
from expresslane.spec import NgramProposer

from .conftest import random_prompts


def test_ngram_proposer_finds_the_latest_continuation():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert p.propose([5, 6, 7], 3) == []
    assert p.propose([4, 4, 4], 5) == [4]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_outputs_identical_with_ngram_speculation(llama_dir, batch):
    base = random_prompts(batch, 10, 40, seed=21)
    prompts = [p + p[:12] for p in base]  # the prompt repeats itself: n-grams to look up
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32").generate(prompts, params)
    spec_llm = LLM(
        str(llama_dir), dtype="float32", speculative={"method": "ngram", "num_tokens": 4}
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
