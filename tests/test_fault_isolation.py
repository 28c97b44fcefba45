"""Fault isolation: no request's parameters can make an engine step raise (admission checks),
and a step that raises all the same fails only the requests that make it raise; the others
finish with the tokens they would have had without them. A fault of every request alike (the
device's) fails that batch, and the engine then serves new requests as before."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict

import pytest

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.engine.request import Request
from expresslane.engine.submission import Submission
from expresslane.errors import InvalidRequestError

from .conftest import VOCAB, random_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)
LANES = ("ultrafast", "default", "flex")
CULPRIT = "the engine could not run this request: ValueError"


def new_engine(llama_dir, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", **options))


def poison(engine: LLMEngine, rid: str, lane: str, prompt: list[int], **bad) -> Request:
    """A sampled request with a value admission now refuses (seed=2**70, top_k=2**63), made
    as a `Request` directly, as a caller that skips `make_request` would."""
    params = SamplingParams(max_tokens=8, temperature=1.0)
    for name, value in bad.items():
        setattr(params, name, value)
    return Request(rid, prompt, params, lane=lane, max_tokens=8)


def good_requests(engine: LLMEngine) -> list[Request]:
    """Greedy requests of every lane (the ultrafast lane speculates with n-gram lookup), and
    a seeded sampled one: its generator must be set back when its step is run again."""
    prompts = random_prompts(7, 5, 40, seed=11)
    prompts[0] = prompts[0][:6] * 5  # repeats: n-gram guesses for the ultrafast lane
    reqs = [
        engine.make_request(
            Submission(p, SamplingParams(max_tokens=24, **GREEDY), f"g{i}", LANES[i % 3])
        )
        for i, p in enumerate(prompts[:6])
    ]
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    reqs.append(engine.make_request(Submission(prompts[6], sampled, "seeded", "default")))
    return reqs


def drive(engine: LLMEngine, reqs: list[Request], later: dict[int, list[Request]] | None = None):
    """Step until done, adding `later[i]` before step i; every output by request id."""
    later = dict(later or {})
    for r in reqs:
        engine.add(r)
    outs: dict[str, list] = defaultdict(list)
    i = 0
    while engine.has_unfinished() or later:
        for r in later.pop(i, []):
            engine.add(r)
        for out in engine.step():
            outs[out.request_id].append(out)
        i += 1
    return outs


def tokens(outs) -> dict[str, list[int]]:
    return {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in outs.items()}


def without_seeded(reference: dict[str, list[int]]) -> dict[str, list[int]]:
    return {rid: ids for rid, ids in reference.items() if rid != "seeded"}


def assert_all_blocks_free(engine: LLMEngine) -> None:
    kv = engine.kv
    assert kv.num_used_blocks == 0 and all(b.ref_count == 0 for b in kv.blocks)
    assert not engine.requests and not engine.scheduler.has_unfinished()
    for spec in engine.speculation.proposers.values():
        # the proposer forgot every request (n-gram: its indexes; suffix: those it tracks)
        assert not getattr(spec.proposer, "indexes", None)
        assert not getattr(spec.proposer, "tracked", None)


@pytest.fixture(scope="module")
def reference(llama_dir):
    engine = new_engine(llama_dir)
    outs = drive(engine, good_requests(engine))
    assert engine.speculation.stats.proposed > 0  # the ultrafast lane did speculate
    return tokens(outs)


def test_poison_requests_fail_alone_and_the_others_are_unchanged(llama_dir, reference):
    engine = new_engine(llama_dir)
    prompt = random_prompts(1, 20, 21, seed=5)[0]
    first = poison(engine, "bad-seed", "flex", prompt, seed=2**70)
    # added later, when the others decode (and the ultrafast ones verify guesses)
    second = poison(engine, "bad-top-k", "ultrafast", prompt, top_k=2**63)
    outs = drive(engine, [*good_requests(engine), first], later={4: [second]})
    got = tokens(outs)
    for rid in ("bad-seed", "bad-top-k"):
        last = outs[rid][-1]
        assert last.finished and last.finish_reason == "error"
        assert last.error.startswith(CULPRIT) and "Overflow" in last.error
        assert got[rid] == []
    assert {rid: got[rid] for rid in reference} == reference
    assert all(outs[rid][-1].finish_reason == "length" for rid in reference)
    assert engine.speculation.stats.proposed > 0
    assert_all_blocks_free(engine)


def test_a_request_whose_tokens_cannot_be_taken_fails_alone(llama_dir, reference):
    """It runs in the model step but raises when its sampled token is recorded (made without
    `make_request`, it has no detokenizer state)."""
    engine = new_engine(llama_dir)
    prompt = random_prompts(1, 20, 21, seed=5)[0]
    params = SamplingParams(max_tokens=8, **GREEDY)
    broken = Request("no-detok", prompt, params, lane="default", max_tokens=8)
    outs = drive(engine, [*good_requests(engine), broken])
    last = outs["no-detok"][-1]
    assert last.finish_reason == "error"
    assert last.error.startswith("the engine could not run this request: AttributeError")
    got = tokens(outs)
    assert {rid: got[rid] for rid in reference} == reference
    assert_all_blocks_free(engine)


def test_a_proposer_that_raises_costs_only_its_guesses(llama_dir, reference):
    engine = new_engine(llama_dir)
    ngram = engine.speculation.proposers["ultrafast"].proposer
    calls = {"n": 0}
    propose = ngram.propose

    def broken_twice(requests, lengths):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("proposer bug")
        return propose(requests, lengths)

    ngram.propose = broken_twice
    outs = drive(engine, good_requests(engine))
    assert calls["n"] > 2
    assert tokens(outs) == reference
    assert_all_blocks_free(engine)


class FailingForward:
    """The runner's model call, raising on its first `failures` calls (a device fault)."""

    def __init__(self, model, failures: int):
        self.model = model
        self.failures = failures
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("device lost")
        return self.model(*args, **kwargs)


def test_a_device_fault_fails_the_batch_then_the_engine_serves_again(llama_dir, reference):
    engine = new_engine(llama_dir)
    params = SamplingParams(max_tokens=24, **GREEDY)
    warm = engine.make_request(Submission(random_prompts(1, 40, 41, seed=3)[0], params, "warm"))
    drive(engine, [warm])
    assert engine.kv.cached  # its prompt's blocks are in the prefix cache
    # three requests in one step: it fails, each half fails, each request fails alone
    flaky = FailingForward(engine.runner.model, failures=5)
    engine.runner.model = flaky
    batch = [
        engine.make_request(Submission(p, params, f"b{i}", lane))
        for i, (p, lane) in enumerate(zip(random_prompts(3, 5, 30, seed=2), LANES, strict=True))
    ]
    for r in batch:
        engine.add(r)
    outs = engine.step()
    assert flaky.calls == 5
    assert sorted(o.request_id for o in outs) == ["b0", "b1", "b2"]
    for o in outs:
        assert o.finished and o.finish_reason == "error"
        assert o.error.startswith("internal engine error") and "device lost" in o.error
    assert_all_blocks_free(engine)
    assert not engine.kv.cached  # what the cache held is no longer trusted
    again = good_requests(engine)
    assert tokens(drive(engine, again)) == reference
    assert_all_blocks_free(engine)


async def collect(stream):
    ids, last = [], None
    async for out in stream:
        ids += out.new_token_ids
        last = out
    return ids, last


async def test_async_engine_streams_of_every_lane_survive_a_poison_request(llama_dir, reference):
    aengine = AsyncEngine(new_engine(llama_dir))
    try:
        eng = aengine.engine
        good = good_requests(eng)
        prompt = random_prompts(1, 20, 21, seed=5)[0]
        bad = [
            poison(eng, "bad-seed", "default", prompt, seed=2**70),
            poison(eng, "bad-top-k", "ultrafast", prompt, top_k=10**100),
        ]
        streams = [aengine.enqueue(r) for r in [*good[:4], bad[0], *good[4:], bad[1]]]
        results = dict(
            zip(
                [s.request_id for s in streams],
                await asyncio.gather(*(collect(s) for s in streams)),
                strict=True,
            )
        )
        for rid in ("bad-seed", "bad-top-k"):
            ids, last = results.pop(rid)
            assert (
                ids == []
                and last.finish_reason == "error"
                and last.error.startswith("the engine could not run this request")
            )
        # greedy ones only: a sampled request's draws follow the pads its decoding gets
        # beside the ultrafast lane's guesses (guesses.py `uniform`), which depend on timing
        del results["seeded"]
        assert {rid: ids for rid, (ids, _) in results.items()} == without_seeded(reference)
        assert all(last.finish_reason == "length" for _, last in results.values())
        for _ in range(100):
            if not eng.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert_all_blocks_free(eng)
    finally:
        aengine.shutdown()


async def test_async_engine_recovers_from_a_step_that_raises_outside_the_model(llama_dir):
    """A fault outside the model step (here the scheduler's) fails what is in flight; the
    engine starts over from an empty KV pool and serves the next requests."""
    aengine = AsyncEngine(new_engine(llama_dir), calibrate=False)
    try:
        eng = aengine.engine
        schedule = eng.scheduler.schedule
        calls = {"n": 0}

        def broken_once():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("scheduler bug")
            return schedule()

        eng.scheduler.schedule = broken_once
        params = SamplingParams(max_tokens=12, **GREEDY)
        prompt = random_prompts(1, 20, 21, seed=6)[0]
        ids, last = await collect(aengine.submit(prompt, params))
        assert ids == [] and last.finish_reason == "error" and "scheduler bug" in last.error
        ids, last = await collect(aengine.submit(prompt, params))
        solo = LLM(str(llama_dir), dtype="float32").generate(prompt, params)[0].token_ids
        assert ids == solo and last.finish_reason == "length"
        assert eng.kv.num_used_blocks == 0
    finally:
        aengine.shutdown()


# -- admission --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=10**100), "seed"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_p=-math.inf), "top_p"),
        (dict(top_k=1.5), "top_k"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(stop=["x"] * 17), "stop"),
        (dict(stop=["x" * 1001]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["7"]), "stop_token_ids"),
    ],
)
def test_sampling_params_out_of_range(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and e.value.status == 400
    assert param in e.value.message


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (dict(stop_token_ids=[3, 10**100]), "stop_token_ids"),
        (dict(max_tokens=None, min_tokens=10**6), "min_tokens"),
    ],
)
def test_make_request_checks_what_needs_the_model(llm, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.make_request(Submission([5, 6, 7], SamplingParams(**kwargs)))
    assert e.value.param == param


def test_cache_salt_must_be_a_string(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.make_request(Submission([5, 6, 7], SamplingParams(), cache_salt=7))
    assert e.value.param == "cache_salt"


@pytest.mark.parametrize("top_k", [2**63, 10**100, VOCAB])
def test_a_top_k_past_the_vocabulary_is_no_filter(llm, top_k):
    prompt = random_prompts(1, 10, 11, seed=4)[0]
    sp = dict(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    req = llm.engine.make_request(Submission(prompt, SamplingParams(top_k=top_k, **sp)))
    assert req.params.top_k == 0
    out = llm.generate(prompt, SamplingParams(top_k=top_k, **sp))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == llm.generate(prompt, SamplingParams(top_k=0, **sp))[0].token_ids


def test_the_largest_seed_runs(llm):
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    first = llm.generate([5, 6, 7, 8], sp)[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 8
    assert llm.generate([5, 6, 7, 8], sp)[0].token_ids == first.token_ids
