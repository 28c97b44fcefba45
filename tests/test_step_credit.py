"""What the lanes below an "auto" lane may add to a step: predicted, then measured
(engine/step_credit.py), and the scheduler and planner work that capped requests cost."""

from __future__ import annotations

import pytest

from expresslane import SamplingParams
from expresslane.config import EngineConfig
from expresslane.engine.engine import LLMEngine
from expresslane.engine.step_credit import StepCredit

from .conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


def test_the_share_is_saved_up_to_one_step_and_spent_as_predicted():
    credit = StepCredit()
    assert credit.open(0.010, 0.8) == pytest.approx(0.0125)  # 1/0.8 - 1 of 10 ms
    credit.close(0.010, lower_rows=False)
    assert credit.open(0.010, 0.8) == pytest.approx(0.015)  # saved up
    for _ in range(5):
        credit.close(0.010, lower_rows=False)
        credit.open(0.010, 0.8)
    assert credit.balance == pytest.approx(0.010)  # never more than one step's time
    credit.close(0.016, lower_rows=True)
    assert credit.balance == pytest.approx(0.004)
    credit.close(0.016, lower_rows=False)  # a step without a relative target
    assert credit.balance == 0.0


def test_measured_cost_beyond_the_prediction_is_charged_too():
    credit = StepCredit()
    for _ in range(3):  # the targeted rows alone run at half their predicted time
        credit.open(0.010, 0.5)
        credit.close(0.010, lower_rows=False)
        credit.settle(0.005)
    credit.open(0.010, 0.5)
    assert credit.balance == pytest.approx(0.010)
    credit.close(0.012, lower_rows=True)  # predicted: the lower rows add 2 ms ...
    credit.settle(0.011)  # ... measured: 11 - 5 = 6 ms
    assert credit.balance == pytest.approx(0.010 - 0.006)
    credit.open(0.010, 0.5)
    credit.close(0.011, lower_rows=True)
    credit.settle(0.005)  # cheaper than predicted: the prediction is charged
    assert credit.balance == pytest.approx(0.010 - 0.001)
    credit.open(0.010, 0.5)
    credit.close(0.011, lower_rows=True)
    credit.settle(1.0)  # a stall: the debt is at most one step's time
    assert credit.balance == pytest.approx(-0.010)


def test_without_a_measured_pace_the_prediction_stands_in():
    credit = StepCredit()
    credit.open(0.010, 0.5)
    credit.close(0.012, lower_rows=True)
    credit.settle(0.015)  # 15 - 10 = 5 ms against 2 predicted
    assert credit.balance == pytest.approx(0.010 - 0.005)


def _engine(llama_dir, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", **options))


def _run_beside_defaults(llama_dir, measured: bool):
    """An ultrafast request with eight default ones beside it (added after it ran ten steps
    alone; prompts of 150-250 tokens), under a step model that prices every row at a
    microsecond: each step's batch and the lower lanes' balance after it, and every
    request's greedy output."""
    lanes = {"ultrafast": {"max_batch": 1, "speculative": False, "solo_fraction": 0.5}}
    engine = _engine(llama_dir, num_kv_blocks=512, lanes=lanes)
    engine.step_model.refit_every = 10**9
    engine.step_model.set_costs([1e-6, 1e-6, 0.0, 0.0])
    engine.targets.resolve()
    credit = engine.scheduler.credit
    if not measured:
        credit.settle = lambda seconds: None
    prompt = random_prompts(1, 5, 12, seed=21)[0]
    fast = engine.add_request(
        prompt, SamplingParams(max_tokens=48, **GREEDY), request_id="u", lane="ultrafast"
    )
    for _ in range(10):  # alone: its pace is measured
        engine.step()
    params = SamplingParams(max_tokens=80, **GREEDY)  # they outlast the ultrafast request
    prompts = random_prompts(8, 150, 250, seed=22)
    slow = [engine.add_request(p, params, request_id=f"d{i}") for i, p in enumerate(prompts)]
    steps = []
    while not fast.is_finished:
        batch = engine.scheduler.schedule
        engine.scheduler.schedule = lambda b=batch: steps.append([b()]) or steps[-1][0]
        engine.step()
        engine.scheduler.schedule = batch
        steps[-1].append(credit.balance)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return steps, [r.output_token_ids for r in (fast, *slow)]


def test_lower_rows_that_cost_more_than_predicted_run_less_often(llama_dir):
    """By prediction alone the default rows run in every step. Measured, a step whose lower
    rows took far more than their predicted microseconds leaves the most debt there is (one
    step's predicted time, 2 us), and the next step runs the ultrafast request alone. Greedy
    outputs are the same either way, and no block is left behind."""
    predicted, outputs = _run_beside_defaults(llama_dir, measured=False)
    assert all(len(batch.items) > 1 for batch, _ in predicted)
    measured, same_outputs = _run_beside_defaults(llama_dir, measured=True)
    base = 2e-6  # one sequence, one token: 1 us + 1 us
    in_debt = [i for i, (_, balance) in enumerate(measured) if balance <= -base + 1e-12]
    assert in_debt  # the prompts' rows cost milliseconds
    for i in in_debt[:-1] if in_debt[-1] == len(measured) - 1 else in_debt:
        assert len(measured[i + 1][0].items) == 1  # paid back by a step of its own
    assert same_outputs == outputs


def test_capped_requests_are_not_padded_with_the_targeted_lanes_guesses(llama_dir):
    lanes = {"ultrafast": {"max_batch": 1, "speculative": {"method": "ngram", "num_tokens": 4}}}
    engine = _engine(llama_dir, num_kv_blocks=512, lanes=lanes)
    base = random_prompts(1, 8, 9, seed=22)[0]
    params = SamplingParams(max_tokens=16, **GREEDY)
    slow = [engine.add_request(p, params) for p in random_prompts(4, 5, 9, seed=23)]
    fast = engine.add_request(base * 4, params, lane="ultrafast")  # repetitive: guesses
    uniform, guessed = engine.speculation.planner.uniform, []

    def checked(running, costs):
        uniform(running, costs)
        guessed.append(len(fast.spec.guesses))
        assert all(not r.spec.guesses for r in slow)  # no pads for a lane that does not guess

    engine.speculation.planner.uniform = checked
    while engine.has_unfinished():
        engine.step()
    assert max(guessed) > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
