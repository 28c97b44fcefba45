"""Grammar-constrained decoding on the demo model: every output obeys its grammar, at any batch
mix of constrained and free requests, with chunked prefill and preemption, and greedy outputs
are the same with and without each speculative proposer."""

from __future__ import annotations

import json
import string

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from expresslane.config import EngineConfig
from expresslane.demo import demo_model_dir
from expresslane.engine.engine import LLMEngine
from expresslane.engine.submission import Submission
from expresslane.errors import InvalidRequestError
from expresslane.sampling_params import Grammar, SamplingParams
from expresslane.server.grammars import json_schema, tool_calls
from expresslane.server.prompt import render, template_tools
from expresslane.server.tool_parsers import HermesToolParser

SPECULATION = {
    "plain": None,  # no guesses at all, not even the tokens a grammar forces
    "none": None,
    "ngram": {"method": "ngram", "num_tokens": 6, "adaptive": False, "max_batch": 64},
    "suffix": {"method": "suffix", "num_tokens": 6, "adaptive": False, "max_batch": 64},
    "draft": {"method": "draft", "num_tokens": 4, "adaptive": False, "max_batch": 64},
}
MAX_TOKENS = 64
CASES_PER_EXAMPLE = 50
PARSER = HermesToolParser()


@pytest.fixture(scope="module")
def engines() -> dict[str, LLMEngine]:
    engines = {
        name: LLMEngine(
            EngineConfig(model=str(demo_model_dir()), seed=0, num_kv_blocks=2048, speculative=spec)
        )
        for name, spec in SPECULATION.items()
    }
    engines["plain"].speculation.planner.add_forced = lambda running: None
    # chunked prefill (16-token chunks) and preemption (blocks for a fraction of the batch)
    engines["tight"] = LLMEngine(
        EngineConfig(
            model=str(demo_model_dir()), seed=0, num_kv_blocks=24, max_num_batched_tokens=16
        )
    )
    return engines


# -- generated schemas and tools --------------------------------------------------------------

names = st.text(string.ascii_lowercase + "_", min_size=1, max_size=10)
leaf = st.sampled_from(
    [
        {"type": "string", "maxLength": 8},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    ]
)


def objects(values) -> st.SearchStrategy[dict]:
    return st.dictionaries(names, values, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(required),
                "additionalProperties": False,
            }
        )
    )


schemas = objects(leaf | objects(leaf))
tools = st.lists(
    st.builds(lambda n, p: {"name": n, "parameters": p}, names, schemas),
    min_size=1,
    max_size=4,
    unique_by=lambda t: t["name"],
)
choices = st.sampled_from(["auto", "required", "none", "named"])


@st.composite
def cases(draw) -> dict:
    if draw(st.booleans()):
        return {"schema": draw(schemas), "prompt": "Give me the data as JSON."}
    declared = draw(tools)
    choice = draw(choices)
    if choice == "named":
        choice = {"name": draw(st.sampled_from([t["name"] for t in declared]))}
    return {
        "tools": declared,
        "choice": choice,
        "parallel": draw(st.booleans()),
        "prompt": draw(st.sampled_from(["List the files.", "Read main.py", "hi"])),
    }


# -- running them ----------------------------------------------------------------------------


def _request(eng: LLMEngine, case: dict) -> tuple[str, SamplingParams]:
    messages = [{"role": "user", "content": case["prompt"]}]
    if "schema" in case:
        grammar = json_schema(case["schema"], "response_format")
        prompt = render(eng.tokenizer, messages, None)
    else:
        literal = eng.grammars.literal
        grammar = tool_calls(
            PARSER.markup, case["tools"], case["choice"], case["parallel"], literal
        )
        with_tools = template_tools(case["tools"]) if case["choice"] != "none" else None
        prompt = render(eng.tokenizer, messages, with_tools)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)
    return prompt, params


def _run(eng: LLMEngine, batch: list[dict]) -> list:
    reqs = []
    for i, case in enumerate(batch):
        prompt, params = _request(eng, case)
        reqs.append(eng.add_request(prompt, params, add_special_tokens=False))
        if i % 3 == 0:  # free requests in the same batches
            eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    return reqs


def _check(case: dict, text: str, finish: str) -> None:
    if finish == "length":
        return  # ran out of tokens inside the grammar, as OpenAI's incomplete outputs do
    assert finish == "stop", (case, text, finish)
    if "schema" in case:
        jsonschema.validate(json.loads(text), case["schema"])
        return
    declared = {t["name"]: t["parameters"] for t in case["tools"]}
    calls = PARSER.parse(text, set(declared)).tool_calls
    if case["choice"] == "none":
        assert not calls and "<tool_call>" not in text
    if case["choice"] == "required" or isinstance(case["choice"], dict):
        assert calls, (case, text)
    if isinstance(case["choice"], dict):
        assert {c.name for c in calls} == {case["choice"]["name"]}
    if not case["parallel"] or isinstance(case["choice"], dict):
        assert len(calls) <= 1
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), declared[call.name])


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),  # a failing batch of 50 does not shrink usefully
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(cases(), min_size=CASES_PER_EXAMPLE, max_size=CASES_PER_EXAMPLE))
def test_outputs_follow_their_grammar_with_and_without_speculation(engines, batch):
    outputs = {}
    for name, eng in engines.items():
        reqs = _run(eng, batch)
        outputs[name] = [r.output_token_ids for r in reqs]
        for case, req in zip(batch, reqs, strict=True):
            _check(case, eng.tokenizer.decode(req.output_token_ids), req.finish_reason)
    for name in ("none", "ngram", "suffix", "draft"):
        assert outputs[name] == outputs["plain"], name


def test_grammars_hold_through_preemption_and_chunked_prefill(engines):
    """Long constrained outputs in the tight engine: requests are preempted and their prompts
    recomputed in 16-token chunks; every output stays a valid prefix of its grammar."""
    eng = engines["tight"]
    schema = {"type": "array", "minItems": 64, "items": {"type": "integer", "minimum": 0}}
    grammar = json_schema(schema, "response_format")
    params = SamplingParams(max_tokens=48, temperature=0.0, grammar=grammar)
    prompt = render(eng.tokenizer, [{"role": "user", "content": "Numbers, please."}], None)
    reqs = [eng.add_request(prompt + str(i), params, add_special_tokens=False) for i in range(24)]
    while eng.has_unfinished():
        eng.step()
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.finish_reason == "length"
        assert eng.grammars.matcher(grammar).validate_tokens(r.output_token_ids) == 48


def test_step_masks_match_a_plain_reference(engines):
    """The sampler's masked greedy tokens, for plain rows and for rows that verify guesses,
    equal a plain argmax over the tokens a fresh matcher allows in the same state."""
    eng = engines["none"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = json_schema(schema, "response_format")
    greedy = SamplingParams(temperature=0.0, grammar=grammar)
    reqs = [eng.make_request(Submission("x", greedy)) for _ in range(3)]
    history = [[], _tokens(eng, '{"n": 1'), []]  # what each has generated so far
    reqs[1].matcher.consume_tokens(history[1])
    reqs[2].spec.guesses = _tokens(eng, '{"n"') + [7]  # the last guess breaks the grammar
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    items = [(r, 1 + len(r.spec.guesses)) for r in reqs]
    masks = eng.grammars.start(items)
    owners = [k for k, (_, n) in enumerate(items) for _ in range(n)]
    offsets = [j for _, n in items for j in range(n)]
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(len(owners), eng.model_config.vocab_size, generator=rng)
    got = eng.runner.sampler(logits, [reqs[k] for k in owners], offsets, masks).token_ids
    for i, (k, j) in enumerate(zip(owners, offsets, strict=True)):
        ref = eng.grammars.matcher(grammar)
        ref.consume_tokens(history[k] + reqs[k].spec.guesses[:j])
        if ref.is_error():  # past the invalid guess: the row is not constrained
            assert got[i] == int(logits[i].argmax())
            continue
        allowed = torch.tensor(list(ref.compute_logit_bias()), dtype=torch.int32) > 0
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - len(allowed)))
        assert got[i] == int(logits[i].masked_fill(~allowed, float("-inf")).argmax())


def _tokens(eng: LLMEngine, text: str) -> list[int]:
    return eng.tokenizer.encode(text, False)


def test_bad_schemas_fail_alone_with_the_field_named(engines):
    eng = engines["none"]
    ok = eng.add_request("a", SamplingParams(max_tokens=4, temperature=0.0))
    for schema in ({"type": "strin"}, {"type": "object", "properties": {"x": {"not": {}}}}):
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request("a", SamplingParams(grammar=json_schema(schema, "response_format")))
        assert e.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        eng.add_request("a", SamplingParams(grammar=Grammar("start: nope", "text.format")))
    while eng.has_unfinished():
        eng.step()
    assert ok.finish_reason == "length"


def test_forced_guesses_kept_over_a_capped_step(engines):
    """A constrained request of a lane without a proposer that keeps its forced guesses over
    a step that capped it (the planner runs twice before its tokens are verified)."""
    eng = engines["plain"]
    path = {"const": "src/expresslane/main.py"}
    schema = {"type": "object", "properties": {"path": path}, "required": ["path"]}
    params = SamplingParams(
        max_tokens=24, temperature=0.0, grammar=json_schema(schema, "response_format")
    )
    req = eng.add_request("x", params, lane="flex")
    while not req.num_output_tokens or not req.matcher.compute_ff_tokens():
        assert eng.has_unfinished()
        eng.step()  # until the grammar forces tokens (the key's, the path's)
    engines["none"].speculation.planner.add_forced(eng.scheduler.running)
    assert req.spec.guesses and req.spec.forced
    engines["none"].speculation.planner.add_forced(eng.scheduler.running)  # the capped step's turn
    assert req.spec.forced
    while eng.has_unfinished():
        eng.step()
    assert req.finish_reason in ("stop", "length")


def test_the_offline_api_takes_a_grammar():
    from expresslane import LLM

    llm = LLM(str(demo_model_dir()), seed=0)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=64, temperature=0.0, grammar=json_schema(schema, "schema"))
    prompt = render(llm.engine.tokenizer, [{"role": "user", "content": "Data as JSON."}], None)
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
