"""A server whose engine runs at tensor-parallel size 2 (engine/parallel/). The server API
tests imported below run here again, on this file's fixtures (the tiny Llama and the demo
model, each split over two gloo ranks); then a rank is killed under a running server."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread
from .test_chat_completions import (  # noqa: F401
    test_plain,
    test_stream_chunks_include_usage_and_equality,
    test_stream_helper,
)
from .test_completions import (  # noqa: F401
    test_health_and_metrics,
    test_streamed_equals_plain_with_echo_and_logprobs,
    test_string_and_token_prompts,
)
from .test_responses import (  # noqa: F401
    test_background_poll_and_cancel,
    test_create_plain,
    test_previous_response_chain_hits_prefix_cache,
    test_stream_events_and_equality_with_non_streamed,
)
from .test_structured_outputs import (  # noqa: F401
    test_chat_completions_parse,
    test_json_object_on_both_apis,
)
from .test_websocket import test_events_match_http  # noqa: F401


def tp_engine(model: str | None, **options) -> AsyncEngine:
    config = EngineConfig(model=model, tensor_parallel_size=2, calibrate=False, seed=0, **options)
    return AsyncEngine(LLMEngine(config))


@pytest.fixture(scope="module")
def tp_llama(llama_dir):
    engine = tp_engine(str(llama_dir), num_kv_blocks=1024, max_batch=64)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(tp_llama):
    with ServerThread(create_app(tp_llama, ServerSettings(store_path=":memory:"))) as s:
        yield s


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def demo_url():
    """The bundled demo model (its tokenizer makes grammars) at tensor-parallel size 2."""
    engine = tp_engine(None, num_kv_blocks=512)
    try:
        settings = ServerSettings(store_path=":memory:", served_model_name="demo")
        with ServerThread(create_app(engine, settings)) as s:
            yield s.url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def demo(demo_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_url + "/v1", api_key="test", max_retries=0)


def test_greedy_chat_equals_size_1(client, model_name, llama_dir):
    """The same greedy completion as the engine of one process gives."""
    from expresslane import LLM, SamplingParams

    prompt = [5, 17, 99, 230, 7, 41]
    c = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    llm = LLM(str(llama_dir))
    one = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert c.choices[0].text == one.text


def test_a_killed_rank_gives_errors_and_a_log_line(llama_dir, caplog):
    engine = tp_engine(str(llama_dir), num_kv_blocks=256)
    try:
        with ServerThread(create_app(engine, ServerSettings(store_path=":memory:"))) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="t", max_retries=0)
            ask = dict(model=client.models.list().data[0].id, prompt="a b c", max_tokens=4)
            assert client.completions.create(**ask).choices[0].finish_reason == "length"
            worker = engine.engine.parallel.processes[0]
            worker.kill()
            worker.join()
            with caplog.at_level(logging.ERROR, logger="expresslane.engine"):
                for _ in range(2):
                    with pytest.raises(openai.APIStatusError) as failed:
                        client.completions.create(**ask)
                    assert failed.value.status_code >= 500
            assert "tensor parallelism broke" in caplog.text
            assert "tensor-parallel rank 1" in caplog.text
            assert httpx.get(s.url + "/health").status_code == 503  # out of the balancer
    finally:
        engine.shutdown()
