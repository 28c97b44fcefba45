"""The prefix cache is shared only within one owner when the server has API keys (reuse across
tenants is a timing side channel), and only among requests with the same `cache_salt`."""

from __future__ import annotations

import json

import openai
import pytest

from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread
from .test_accounts import run_cli

PROMPT = list(range(10, 90))  # 80 tokens: five full KV blocks


@pytest.fixture(scope="module")
def keyed(llama_dir, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("prefix") / "accounts.sqlite")

    def create(name: str) -> str:
        out = run_cli("keys", "create", name, "--tiers", "default", "--json", "--db", db)
        return json.loads(out)["key"]

    keys = {"a1": create("alice"), "a2": create("alice"), "b": create("bob")}
    engine = AsyncEngine(
        LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=512, seed=0, calibrate=False))
    )
    settings = ServerSettings(store_path=":memory:", accounts_path=db)
    with ServerThread(create_app(engine, settings)) as s:
        yield s, keys
    engine.shutdown()


def cached(server, key: str, prompt: list[int], **extra) -> int:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    r = c.completions.create(model="llama", prompt=prompt, max_tokens=1, extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


def test_prefixes_are_shared_within_an_owner_only(keyed):
    server, keys = keyed
    prompt = [7, *PROMPT]
    assert cached(server, keys["a1"], prompt) == 0
    assert cached(server, keys["a2"], prompt) > 0  # another key of the same owner
    assert cached(server, keys["b"], prompt) == 0  # another owner computes it anew
    assert cached(server, keys["b"], prompt) > 0


def test_cache_salt_isolates_within_an_owner(keyed):
    server, keys = keyed
    prompt = [8, *PROMPT]
    assert cached(server, keys["a1"], prompt, cache_salt="s1") == 0
    assert cached(server, keys["a1"], prompt, cache_salt="s2") == 0
    assert cached(server, keys["a2"], prompt, cache_salt="s1") > 0
    assert cached(server, keys["a1"], prompt) == 0  # no salt is a cache of its own


def test_open_mode_shares_and_salt_still_isolates(server):
    prompt = [9, *PROMPT]
    assert cached(server, "x", prompt) == 0
    assert cached(server, "y", prompt) > 0
    assert cached(server, "x", prompt, cache_salt="mine") == 0
