"""A lane's promise (promise.py) and admission by prediction (engine/lane_room.py): verdicts,
settings, the promise stated from the step-latency model, and the lane's room as the real
engine's scheduler sees it with a step-latency model of known costs."""

from __future__ import annotations

import pytest

from expresslane.config import EngineConfig
from expresslane.engine.engine import LLMEngine
from expresslane.engine.lane_room import PROMISE_OF_TARGET, _round
from expresslane.errors import InvalidRequestError
from expresslane.lanes import build_lanes
from expresslane.promise import Promise
from expresslane.sampling_params import SamplingParams

from .conftest import random_prompts

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
# Step costs: 10 ms + 10 ms per sequence. Under "auto" (the lower lanes add 1/0.95 - 1 of the
# step), n ultrafast requests decode at 0.95 / (0.01 + 0.01 n) tokens/s each: 47.5, 31.7,
# 23.75. A promise of 30 tokens/s has room for two.
COSTS = [0.01, 0.01, 0.0, 0.0]
PROMISE = {"tokens_per_s": 30.0, "ttft_s": 5.0}


def stated(**values):
    return Promise(**{"tokens_per_s": 100.0, "ttft_s": 0.5, **values}).stated(0, 0)


def test_verdicts():
    p = stated()  # floor 50 tokens/s, TTFT 0.5 s per 1024 prompt tokens, speed from 16 tokens
    assert p.judge(10, 32, 0.1, 31 / 80).kept
    slow = p.judge(10, 32, 0.1, 31 / 40)
    assert (slow.kept, slow.missed, round(slow.delivered_tokens_per_s)) == (False, "speed", 40)
    assert p.judge(10, 32, 0.6, 31 / 80).missed == "ttft"
    assert p.judge(10, 0, None, None).missed == "ttft"  # no token at all
    assert p.judge(4096, 32, 1.9, 31 / 80).kept  # 4x the prompt: 4x the TTFT
    assert p.judge(10, 8, 0.1, 7 / 10).kept  # too few tokens to judge a speed by


def test_settings_are_checked():
    with pytest.raises(InvalidRequestError, match="unknown promise setting"):
        build_lanes({"ultrafast": {"promise": {"tokens": 3}}})
    with pytest.raises(InvalidRequestError, match="tokens_per_s must be a positive"):
        build_lanes({"ultrafast": {"promise": {"tokens_per_s": 0}}})
    with pytest.raises(InvalidRequestError, match="needs a target"):
        build_lanes({"default": {"promise": {}}})
    assert build_lanes({"ultrafast": {"promise": False}})["ultrafast"].promise is None
    # a lane whose target is unset keeps no promise (nothing would keep it)
    assert build_lanes({"ultrafast": {"target_tokens_per_s": None}})["ultrafast"].promise is None
    assert build_lanes(None)["ultrafast"].promise == Promise()


def test_published_numbers_round_to_the_safe_side():
    assert _round(47.93) == 47.0 and _round(0.01234, up=True) == 0.013
    assert _round(1234.0) == 1200.0


def _engine(llama_dir, promise, **options) -> LLMEngine:
    lanes = {"ultrafast": {"max_batch": 4, "speculative": False, "promise": promise}}
    config = EngineConfig(
        model=str(llama_dir), dtype="float32", num_kv_blocks=256, lanes=lanes, **options
    )
    engine = LLMEngine(config)
    engine.step_model.set_costs(COSTS)
    engine.step_model.refit_every = 10**9  # the costs stay as set while the test steps
    engine.targets.resolve()
    return engine


def test_auto_promise_is_stated_from_the_target(llama_dir):
    engine = _engine(llama_dir, {})
    p = engine.scheduler.room.stated["ultrafast"]
    target = engine.targets.per_request()["ultrafast"]
    assert p.measured and p.tokens_per_s == _round(PROMISE_OF_TARGET * target)
    assert p.ttft_s >= 0.25  # the floor: a prefill of 1024 tokens takes 20 ms here


def test_room_by_prediction_and_queued_requests_wait(llama_dir):
    engine = _engine(llama_dir, PROMISE)
    room = engine.scheduler.has_room
    prompts = random_prompts(4, 8, 16)
    assert room("ultrafast", 10)  # nothing running
    engine.add_request(prompts[0], LONG, request_id="u0", lane="ultrafast")
    engine.step()
    assert room("ultrafast", 10)  # a second: 31.7 tokens/s each
    assert not room("ultrafast", 10, in_flight=2)  # one handed over, not yet scheduled
    engine.add_request(prompts[1], LONG, request_id="u1", lane="ultrafast")
    engine.step()
    assert not room("ultrafast", 10)  # a third: 23.75 tokens/s each, under the 30 promised
    assert room("default", 10)  # lanes without a promise: room up to their max batch
    # A third request that was queued anyway (its key's policy) waits for room to start
    engine.add_request(prompts[2], LONG, request_id="u2", lane="ultrafast")
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"u0", "u1"} and engine.requests["u2"] in engine.scheduler.waiting
    engine.abort("u0")
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"u1", "u2"}


def test_a_long_prompt_needs_ttft_room(llama_dir):
    # 10 ms per token: beside one decode, a prompt of 100 tokens prefills in about 1.1 s of
    # the 5 s promised; one of 2,000 needs 21 s of the 9.8 s its length is allowed.
    engine = _engine(llama_dir, PROMISE)
    engine.step_model.set_costs([0.01, 0.0, 0.01, 0.0])
    engine.add_request(random_prompts(1, 8, 9)[0], LONG, request_id="u0", lane="ultrafast")
    engine.step()
    assert engine.scheduler.has_room("ultrafast", 100)
    assert not engine.scheduler.has_room("ultrafast", 2_000)


def test_a_request_the_promise_holds_back_preempts_no_flex(llama_dir):
    engine = _engine(llama_dir, PROMISE, max_batch=3)  # sequence slots: two ultrafast + flex
    prompts = random_prompts(4, 8, 16)
    engine.add_request(prompts[3], LONG, request_id="f", lane="flex")
    for i in range(2):
        engine.add_request(prompts[i], LONG, request_id=f"u{i}", lane="ultrafast")
    flex = engine.requests["f"]
    for _ in range(100):  # flex gets its share of the steps in time
        engine.step()
        if flex.num_computed_tokens > 0:
            break
    engine.add_request(prompts[2], LONG, request_id="u2", lane="ultrafast")
    for _ in range(5):
        engine.step()
    assert flex.metrics.num_preemptions == 0
    assert {r.request_id for r in engine.scheduler.running} == {"u0", "u1", "f"}


def test_a_lane_measured_below_its_promise_has_no_room(llama_dir):
    # The model predicts 3 million tokens/s for two requests; the real ones decode far slower.
    engine = _engine(llama_dir, {"tokens_per_s": 1e6, "ttft_s": 5.0})
    engine.step_model.set_costs([1e-7, 1e-7, 0.0, 0.0])
    req = engine.add_request(random_prompts(1, 8, 9)[0], LONG, request_id="u0", lane="ultrafast")
    engine.step()
    assert engine.scheduler.has_room("ultrafast", 10)  # no speed measured yet
    while req.metrics.recent_tokens_per_s is None:
        engine.step()
    assert not engine.scheduler.has_room("ultrafast", 10)
