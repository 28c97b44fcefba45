"""Lanes in the engine: ultrafast first, per-lane batch limits, the step-time cap on the lower
lanes (from the step-latency model), flex preemption, per-lane speculation, calibration."""

from __future__ import annotations

import numpy as np
import pytest

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig
from expresslane.engine.engine import LLMEngine
from expresslane.engine.step_model import StepLatencyModel, features
from expresslane.engine.submission import Submission
from expresslane.errors import InvalidRequestError
from expresslane.lanes import build_lanes

from .conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


def _engine(llama_dir, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", **options))


def _run(engine: LLMEngine, reqs) -> None:
    while engine.has_unfinished():
        engine.step()


def _ultrafast_among_defaults(engine: LLMEngine, prompts, params):
    """Default requests of prompts[1:], one step, then an ultrafast one of prompts[0]; every
    batch scheduled from then on is recorded."""
    slow = [engine.add_request(p, params, request_id=f"d{i}") for i, p in enumerate(prompts[1:])]
    engine.step()  # no ultrafast request yet: no cap
    fast = engine.add_request(prompts[0], params, request_id="u", lane="ultrafast")
    batches = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: batches.append(schedule()) or batches[-1]
    return slow, fast, batches


@pytest.fixture(scope="module")
def solo(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32")
    return lambda prompt, n: (
        llm.generate(prompt, SamplingParams(max_tokens=n, **GREEDY))[0].token_ids
    )


def test_step_model_recovers_known_costs_without_negative_coefficients():
    rng = np.random.default_rng(0)
    model = StepLatencyModel(refit_every=10**9)
    truth = np.array([0.004, 0.0002, 0.00001, 0.0])  # no context cost at all
    for i in range(200):
        seqs = int(rng.integers(1, 9 if i % 2 else 64))
        tokens = seqs if i % 2 else seqs + int(rng.integers(8, 400))  # small and large steps
        ctx = int(rng.integers(0, 20000))
        y = float(truth @ features(seqs, tokens, ctx)) * (1 + rng.normal(0, 0.02))
        model.observe(seqs, tokens, ctx, y)
    model.fit()
    assert all((f.coef >= 0).all() for f in model.fits.values())
    for seqs, tokens, ctx in [(1, 1, 100), (8, 8, 3000), (32, 32, 8000), (4, 512, 600)]:
        want = float(truth @ features(seqs, tokens, ctx))
        assert model.predict(seqs, tokens, ctx) == pytest.approx(want, rel=0.05)


def test_lane_settings_are_validated(llama_dir):
    with pytest.raises(InvalidRequestError, match="key_share"):
        build_lanes({"ultrafast": {"key_share": 0}})
    with pytest.raises(InvalidRequestError, match="unknown lane"):
        build_lanes({"turbo": {}})
    with pytest.raises(InvalidRequestError, match="unknown setting"):
        build_lanes({"flex": {"speed": 3}})
    with pytest.raises(InvalidRequestError, match="target_tokens_per_s"):
        build_lanes({"ultrafast": {"target_tokens_per_s": -1}})
    with pytest.raises(InvalidRequestError, match="solo_fraction"):
        build_lanes({"ultrafast": {"solo_fraction": 1.5}})
    engine = _engine(llama_dir, num_kv_blocks=64, lanes={"flex": {"enabled": False}})
    with pytest.raises(InvalidRequestError, match="'flex' lane is not served") as e:
        engine.make_request(Submission([1, 2, 3], SamplingParams(max_tokens=2), lane="flex"))
    assert e.value.param == "service_tier"
    assert not engine.requests


def test_ultrafast_runs_first_and_each_lane_keeps_its_batch_limit(llama_dir, solo):
    lanes = {"ultrafast": {"max_batch": 1, "target_tokens_per_s": None}}
    engine = _engine(llama_dir, num_kv_blocks=256, lanes=lanes, max_num_batched_tokens=64)
    prompts = random_prompts(6, 20, 30, seed=11)
    reqs = [
        engine.add_request(p, SamplingParams(max_tokens=8, **GREEDY), lane=lane)
        for p, lane in zip(prompts, ["default"] * 3 + ["ultrafast"] * 3)
    ]
    engine.step()
    running = engine.scheduler.running
    # the token budget (64) fits about two prompts: the first ultrafast one is admitted
    # first, the other ultrafast ones wait for the lane, defaults take the rest
    assert running[0] is reqs[3]
    assert sum(r.lane == "ultrafast" for r in running) == 1
    assert any(r.lane == "default" for r in running)
    while engine.has_unfinished():
        engine.step()
        assert sum(r.lane == "ultrafast" for r in engine.scheduler.running) <= 1
    assert [r.output_token_ids for r in reqs] == [solo(p, 8) for p in prompts]


def test_a_tenant_holds_at_most_its_share_of_a_lane(llama_dir, solo):
    lanes = {"ultrafast": {"max_batch": 4, "target_tokens_per_s": None, "speculative": False}}
    engine = _engine(llama_dir, num_kv_blocks=256, lanes=lanes)
    prompts = random_prompts(7, 8, 12, seed=5)
    params = SamplingParams(max_tokens=6, **GREEDY)
    tenants = ["a", "a", "a", "a", "b", None, None]  # None: no tenant, no share
    reqs = [
        engine.add_request(p, params, lane="ultrafast", tenant=t) for p, t in zip(prompts, tenants)
    ]
    engine.step()
    # "a" holds half of the 4 slots however many it sent; "b" and an untenanted request
    # take the others, the rest wait
    assert sorted(map(str, (r.tenant for r in engine.scheduler.running))) == [
        "None",
        "a",
        "a",
        "b",
    ]
    while engine.has_unfinished():
        engine.step()
        running = [r.tenant for r in engine.scheduler.running]
        assert running.count("a") <= 2
    assert [r.output_token_ids for r in reqs] == [solo(p, 6) for p in prompts]


def test_the_engine_queue_is_bounded(llama_dir):
    engine = _engine(llama_dir, num_kv_blocks=64, max_waiting=2)
    params = SamplingParams(max_tokens=2)
    engine.add_request([5, 6], params)
    engine.add_request([5, 7], params)
    with pytest.raises(InvalidRequestError, match="queue is full"):
        engine.add_request([5, 8], params)
    _run(engine, [])
    engine.add_request([5, 8], params)  # room again once they ran


def test_cap_holds_lower_lanes_to_the_step_budget_and_they_take_turns(llama_dir, solo):
    lanes = {"ultrafast": {"max_batch": 1, "speculative": False}}  # one token per step
    engine = _engine(llama_dir, num_kv_blocks=512, lanes=lanes)
    model = engine.step_model
    model.refit_every = 10**9  # keep the hand-set costs below
    model.set_costs([0.0105, 0.001, 0.0, 0.0])  # 10.5 ms + 1 ms per sequence
    # 16 tok/s = 62.5 ms per step; the scheduler holds 40% of it, 25 ms: 14 sequences per step
    engine.scheduler.set_target("ultrafast", 16.0)
    engine.targets.resolved = True
    prompts = random_prompts(21, 5, 12, seed=12)
    params = SamplingParams(max_tokens=30, **GREEDY)
    slow, fast, batches = _ultrafast_among_defaults(engine, prompts, params)
    assert len(engine.scheduler.running) == 20  # before the ultrafast one: no cap, all started
    while not fast.is_finished:
        engine.step()
        assert len(batches[-1].items) <= 14
        progress = [r.num_output_tokens for r in slow]
        assert max(progress) - min(progress) <= 1  # round robin within the lane
    assert fast.num_output_tokens == 30
    assert max(len(b.items) for b in batches) == 14  # the cap, not something else, binds
    assert max(r.num_output_tokens for r in slow) < 30  # the lower lane was really capped
    _run(engine, slow)
    assert fast.output_token_ids == solo(prompts[0], 30)
    assert [r.output_token_ids for r in slow] == [solo(p, 30) for p in prompts[1:]]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_auto_target_keeps_the_lane_at_its_fraction_of_solo_speed(llama_dir, solo):
    lanes = {"ultrafast": {"max_batch": 1, "speculative": False, "solo_fraction": 0.8}}
    engine = _engine(llama_dir, num_kv_blocks=512, lanes=lanes)
    model = engine.step_model
    model.refit_every = 10**9
    model.set_costs([0.010, 0.001, 0.0, 0.0])  # the ultrafast decode alone: 11 ms
    engine.targets.resolve()
    # by prediction only: the steps' measured times are this machine's and its load's
    # (charging them is test_step_credit's)
    engine.scheduler.credit.settle = lambda seconds: None
    prompts = random_prompts(9, 5, 12, seed=15)
    params = SamplingParams(max_tokens=20, **GREEDY)
    slow, fast, batches = _ultrafast_among_defaults(engine, prompts, params)
    while not fast.is_finished:
        engine.step()
    steps = [model.predict(len(b.items), b.num_tokens, b.context_tokens) for b in batches]
    # the default decodes add 1/0.8 - 1 of the ultrafast step (11 ms) on average, 2.75 ms:
    # 2 or 3 of them a step, what one step leaves saved up for the next (one step at most)
    added = sum(steps) - 0.011 * len(steps)
    assert 0.0025 * len(steps) <= added <= 0.00275 * len(steps) + 1e-9
    assert max(steps) <= 2 * 0.011 + 1e-9
    assert {len(b.items) - 1 for b in batches[1:]} == {2, 3}
    _run(engine, slow)
    assert fast.output_token_ids == solo(prompts[0], 20)
    assert [r.output_token_ids for r in slow] == [solo(p, 20) for p in prompts[1:]]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_flex_gives_way_to_default_and_resumes_without_losing_output(llama_dir, solo):
    engine = _engine(llama_dir, num_kv_blocks=10, max_num_batched_tokens=256)
    prompts = random_prompts(4, 30, 40, seed=13)
    params = SamplingParams(max_tokens=40, **GREEDY)
    flex = [
        engine.add_request(p, params, request_id=f"f{i}", lane="flex")
        for i, p in enumerate(prompts[:3])
    ]
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_blocks < 3  # flex holds (nearly) the whole pool
    before = sum(r.metrics.num_preemptions for r in flex)
    default = engine.add_request(prompts[3], params, request_id="d")
    engine.step()
    assert default in engine.scheduler.running  # admitted at once: flex made room
    assert sum(r.metrics.num_preemptions for r in flex) > before
    _run(engine, flex + [default])
    assert default.metrics.num_preemptions == 0
    assert [r.output_token_ids for r in flex] == [solo(p, 40) for p in prompts[:3]]
    assert default.output_token_ids == solo(prompts[3], 40)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_speculation_can_be_set_per_lane(llama_dir, solo):
    lanes = {"ultrafast": {"speculative": {"method": "ngram", "num_tokens": 3}}}
    engine = _engine(llama_dir, num_kv_blocks=256, lanes=lanes)
    base = random_prompts(1, 8, 9, seed=14)[0]
    prompt = base * 4  # repetitive: the n-gram proposer finds matches
    params = SamplingParams(max_tokens=24, **GREEDY)
    fast = engine.add_request(prompt, params, request_id="u", lane="ultrafast")
    _run(engine, [fast])
    proposed_by_ultrafast = engine.speculation.stats.proposed
    slow = engine.add_request(prompt, params, request_id="d", lane="default")
    _run(engine, [slow])
    assert proposed_by_ultrafast > 0
    assert engine.speculation.stats.proposed == proposed_by_ultrafast  # default does not speculate
    assert fast.output_token_ids == slow.output_token_ids == solo(prompt, 24)


def test_calibration_fits_the_step_model_and_leaves_the_pool_free(llama_dir):
    engine = _engine(llama_dir, num_kv_blocks=1024)
    engine.calibrate()
    assert engine.step_model.ready
    assert len(engine.step_model.calibration) >= 7  # several batch shapes were timed
    assert engine.step_model.predict(1, 1, 64) > 0
    # "auto": the lane keeps 95% of its solo speed, reported as that share of one decode alone
    assert engine.scheduler.solo_fractions == {"ultrafast": 0.95}
    assert "ultrafast" not in engine.scheduler.targets
    # ... measured: the faster quarter of the calibration's decodes alone (three rounds of a
    # request alone after each of the 4+ batch sizes, 15 decodes each, and the last steps of
    # larger batches whose prompts were chunked; the warm-up sweep's are not kept; at most
    # the model's window of the latest)
    solo = engine.step_model.solo_steps
    assert min(solo.maxlen, 3 * 4 * 15) <= len(solo)
    solo_speed = 1 / float(np.percentile(engine.step_model.solo_steps, 25))
    assert engine.targets.per_request() == {"ultrafast": pytest.approx(0.95 * solo_speed)}
    assert not engine.requests and not engine.scheduler.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_most_tokens_is_the_largest_count_that_fits():
    """The scheduler's closed-form fit against a search over every count, on random lines
    (both regimes, a jump between them either way)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        model = StepLatencyModel(small_tokens=8)
        for f in model.fits.values():
            f.coef = rng.uniform(0, 1e-3, 4)
        seqs, tokens, ctx = (int(v) for v in rng.integers(1, 64, 3))
        n, limit = int(rng.integers(0, 40)), float(rng.uniform(0, 0.2))
        fits = [
            k for k in range(n + 1) if model.predict(seqs, tokens + k, ctx + k) <= limit + 1e-12
        ]
        assert model.most_tokens(seqs, tokens, ctx, n, limit) == max(fits, default=0)
