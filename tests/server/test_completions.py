"""Completions (string, batch and token prompts, streamed), /v1/models, /health, /metrics."""

from __future__ import annotations

import openai
import pytest

from .conftest import metric


def test_string_and_token_prompts(client, model_name):
    c = client.completions.create(
        model=model_name, prompt="def fib(n):", max_tokens=5, temperature=0
    )
    assert c.object == "text_completion" and c.choices[0].finish_reason in ("stop", "length")
    assert 1 <= c.usage.completion_tokens <= 5
    t = client.completions.create(
        model=model_name, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0
    )
    assert t.usage.prompt_tokens == 4
    batch = client.completions.create(
        model=model_name, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, temperature=0, n=2
    )
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 6
    strs = client.completions.create(
        model=model_name, prompt=["a b", "c d"], max_tokens=2, temperature=0
    )
    assert len(strs.choices) == 2


def test_streamed_equals_plain_with_echo_and_logprobs(client, model_name):
    kwargs = dict(model=model_name, prompt="import os\n", max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    echo = client.completions.create(echo=True, **kwargs)
    assert echo.choices[0].text == "import os\n" + plain.choices[0].text
    lp = client.completions.create(logprobs=2, **kwargs).choices[0].logprobs
    assert len(lp.tokens) == plain.usage.completion_tokens
    assert "".join(lp.tokens) == plain.choices[0].text
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_models(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nonexistent")


def test_health_and_metrics(client, model_name, http):
    assert http.get("/health").json() == {"status": "ok"}
    client.completions.create(
        model=model_name, prompt="x y", max_tokens=2, extra_body={"service_tier": "flex"}
    )
    text = http.get("/metrics").text
    for name in (
        "expresslane:time_to_first_token_seconds_bucket",
        "expresslane:e2e_request_latency_seconds_count",
        "expresslane:request_queue_time_seconds_count",
        "expresslane:request_time_per_output_token_seconds_count",
        "expresslane:num_requests_running",
        "expresslane:num_requests_waiting",
        "expresslane:kv_cache_used_blocks",
        "expresslane:generation_tokens_total",
    ):
        assert name in text, name
    assert 'tier="flex"' in text
    assert metric(text, "expresslane:kv_cache_total_blocks") == 1024
