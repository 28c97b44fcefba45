"""A model's generation_config.json sampling settings are the defaults of requests that leave
them unset (vLLM's `--generation-config auto`); a request's own value wins."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from expresslane import LLM
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread

DEFAULTS = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.2, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def configured(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("genconf") / "llama"
    shutil.copytree(llama_dir, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **DEFAULTS}))
    return out


@pytest.fixture(scope="module")
def client(configured):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(configured), seed=0)))
    with ServerThread(create_app(engine, ServerSettings(store_path=":memory:"))) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    engine.shutdown()


def test_offline_generate_takes_the_defaults(configured):
    out = LLM(str(configured), seed=0).generate([[5, 6, 7]])[0]
    assert len(out.token_ids) <= 7  # max_new_tokens
    again = LLM(str(configured), seed=1).generate([[5, 6, 7]])[0]
    assert again.token_ids == out.token_ids  # temperature 0: the seed does not matter


def test_requests_take_the_defaults_and_their_own_values_win(client):
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input="hi", max_output_tokens=4)
    assert r.temperature == 0.0  # echoed as used
    r = client.responses.create(model=model, input="hi", max_output_tokens=4, temperature=0.7)
    assert r.temperature == 0.7
    chat = [
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, seed=s
        )
        .choices[0]
        .message.content
        for s in (1, 2, 3)
    ]
    assert len(set(chat)) == 1  # greedy by default, whatever the seed
