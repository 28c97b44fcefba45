"""Structured outputs and forced tool calls from the demo model, through the real clients agents
use: the openai SDK's parse helpers, the OpenAI Agents SDK and LangChain."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread


class Person(BaseModel):
    name: str
    age: int


ASK = "Give me a person as JSON."
TOKENS = 200


@pytest.fixture(scope="module")
def demo_url():
    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine

    engine = AsyncEngine(LLMEngine(EngineConfig(calibrate=False, num_kv_blocks=512, seed=0)))
    try:
        settings = ServerSettings(store_path=":memory:", served_model_name="demo")
        with ServerThread(create_app(engine, settings)) as s:
            yield s.url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def demo(demo_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_url + "/v1", api_key="test", max_retries=0)


@pytest.mark.parametrize("tier", ["default", "ultrafast"])  # ultrafast speculates
def test_chat_completions_parse(demo, tier):
    r = demo.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": ASK}],
        response_format=Person,
        temperature=0,
        max_completion_tokens=TOKENS,
        service_tier=tier,
    )
    assert isinstance(r.choices[0].message.parsed, Person)
    assert r.choices[0].finish_reason == "stop"


def test_responses_parse(demo):
    r = demo.responses.parse(
        model="demo", input=ASK, text_format=Person, temperature=0, max_output_tokens=TOKENS
    )
    assert isinstance(r.output_parsed, Person)
    assert r.text.format.type == "json_schema" and r.text.format.name == "Person"


def test_json_object_on_both_apis(demo):
    c = demo.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": ASK}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=TOKENS,
    )
    assert c.choices[0].finish_reason == "stop", c.choices[0].message.content
    assert isinstance(json.loads(c.choices[0].message.content), dict)
    r = demo.responses.create(
        model="demo",
        input=ASK,
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=TOKENS,
    )
    assert r.status == "completed", r.output_text
    assert isinstance(json.loads(r.output_text), dict)


def test_bad_schemas_are_400s_naming_the_field(demo_url):
    bad = {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    cases = [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": ASK}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": bad},
                },
            },
            "response_format",
        ),
        (
            "/v1/responses",
            {"input": ASK, "text": {"format": {"type": "json_schema", "name": "x", "schema": bad}}},
            "text.format",
        ),
        (
            "/v1/responses",
            {"input": ASK, "tools": [{"type": "function", "name": "f", "parameters": bad}]},
            "tools",
        ),
        (
            "/v1/responses",
            {"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
        ),
    ]
    for path, body, param in cases:
        r = httpx.post(demo_url + path, json={"model": "demo", **body}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
    assert "Unimplemented keys" in error["message"] or "schema" in error["message"]


def test_named_and_required_tool_choice_on_chat(demo):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object"}}},
    ]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = demo.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=tools,
            tool_choice=choice,
            temperature=0,
            max_tokens=TOKENS,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        assert {c.function.name for c in calls} <= {"get_weather", "list_dir"}
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["get_weather"]
            assert set(json.loads(calls[0].function.arguments)) == {"city"}


def test_agents_sdk_output_type_and_named_tool(demo_url):
    agents = pytest.importorskip("agents")
    client = openai.AsyncOpenAI(base_url=demo_url + "/v1", api_key="test", max_retries=0)
    model = agents.OpenAIResponsesModel(model="demo", openai_client=client)
    settings = agents.ModelSettings(temperature=0, max_tokens=TOKENS)
    agent = agents.Agent(name="a", model=model, output_type=Person, model_settings=settings)
    result = agents.Runner.run_sync(agent, ASK, run_config=agents.RunConfig(tracing_disabled=True))
    assert isinstance(result.final_output, Person)

    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    forced = agents.ModelSettings(temperature=0, max_tokens=TOKENS, tool_choice="get_weather")
    agent = agents.Agent(
        name="w",
        model=model,
        tools=[get_weather],
        model_settings=forced,
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(
        agent, "Weather in Paris?", run_config=agents.RunConfig(tracing_disabled=True)
    )
    assert len(seen) == 1 and result.final_output == "sunny"


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(demo_url, method):
    chat_models = pytest.importorskip("langchain_openai")
    llm = chat_models.ChatOpenAI(
        model="demo",
        base_url=demo_url + "/v1",
        api_key="test",
        temperature=0,
        max_tokens=TOKENS,
        max_retries=0,
    )
    # json_mode sends no schema (a JSON object of any shape): the demo model answers a
    # request for a person with the keys it learned for one (scripts/json_answers.py)
    out = llm.with_structured_output(Person, method=method).invoke(ASK)
    assert isinstance(out, Person)


def test_json_only_when_asked(demo):
    """Without a format the demo model answers code with code (issue 44: it once answered every
    prompt with JSON); asked for JSON, it answers JSON. Neither sets max_output_tokens: the
    answers end where the model ends them, not at 16 tokens."""
    code = demo.responses.create(model="demo", input="def add(a, b):", temperature=0)
    assert code.status == "completed"
    assert code.output_text.startswith("```python\ndef add(a, b):"), code.output_text
    compile(code.output_text.split("\n", 1)[1].removesuffix("```"), "reply", "exec")
    asked = demo.responses.create(
        model="demo", input=ASK, temperature=0, text={"format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(asked.output_text), dict)
