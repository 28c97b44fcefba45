"""vLLM's /tokenize and /detokenize on the real server (raw httpx: the openai SDK has no such
calls): counts agree with what the completions and chat endpoints bill, round trips, errors,
API keys (for these and for /v1/responses/input_tokens), and the OpenAPI document."""

from __future__ import annotations

import contextlib
import io
import json

import httpx
import openai
import pytest

from expresslane.cli import main as cli
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import STOP_AT_FIRST, ServerThread

TEXT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
]


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_tokenize_prompt_counts_what_completions_bill(http, client, model_name):
    r = http.post("/tokenize", json={"model": model_name, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    billed = client.completions.create(model=model_name, prompt=TEXT, max_tokens=1)
    assert billed.usage.prompt_tokens == body["count"]
    plain = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["count"] <= body["count"]
    back = http.post("/detokenize", json={"model": model_name, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_tokenize_messages_counts_what_chat_bills(http, client, model_name):
    r = http.post("/tokenize", json={"model": model_name, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=1, extra_body=STOP_AT_FIRST
    )
    assert r.json()["count"] == chat.usage.prompt_tokens
    bare = http.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert bare["count"] < r.json()["count"]
    assert bare["tokens"] == r.json()["tokens"][: bare["count"]]


def test_continue_final_message_ends_with_its_content(http):
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure, the answer is"}]
    r = http.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 200, r.text
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("Sure, the answer is") and "Be brief." in text
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    assert error(http.post("/tokenize", json=both), 400)["param"] == "continue_final_message"


def test_token_strs(http):
    r = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"] and all(isinstance(s, str) for s in r["token_strs"])
    r = http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"]


def test_errors(http, model_name):
    vocab = 512  # the test tokenizer's vocabulary
    for tokens, at in (([1, -1], "tokens[1]"), ([vocab], "tokens[0]")):
        err = error(http.post("/detokenize", json={"model": model_name, "tokens": tokens}), 400)
        assert err["param"] == at and "vocabulary" in err["message"]
    assert error(http.post("/detokenize", json={"tokens": ["a"]}), 400)["param"] == "tokens[0]"
    assert error(http.post("/detokenize", json={}), 400)["param"] == "tokens"
    err = error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    err = error(http.post("/tokenize", json={"model": model_name}), 400)
    assert err["code"] == "missing_required_parameter" and err["param"] == "prompt"
    err = error(http.post("/tokenize", json={"prompt": "x", "stream": True}), 400)
    assert err["code"] == "unknown_parameter"
    err = error(http.post("/tokenize", json={"messages": [{"role": "robot", "content": "x"}]}), 400)
    assert err["param"] == "messages[0].role"
    assert error(http.post("/tokenize", json={"messages": []}), 400)["param"] == "messages"
    broken = http.post("/tokenize", content=b"{", headers={"content-type": "application/json"})
    assert error(broken, 400)["code"] == "invalid_json"


def test_openapi_documents_the_new_routes(http):
    doc = http.get("/openapi.json").json()
    for path in ("/tokenize", "/detokenize", "/v1/responses/input_tokens"):
        post = doc["paths"][path]["post"]
        assert "requestBody" in post, path
        assert {"200", "400", "401", "404"} <= set(post["responses"]), path
        assert "422" not in post["responses"]
    schemas = doc["components"]["schemas"]
    assert {"TokenizePrompt", "TokenizeChat", "TokenizeResponse", "InputTokensRequest"} <= set(
        schemas
    )
    assert "conversation" in schemas["InputTokensRequest"]["properties"]
    assert "token_strs" in schemas["TokenizeResponse"]["properties"]


# -- with API keys -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(llama_dir, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("tokenize") / "accounts.sqlite")

    def create(name: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli(["keys", "create", name, "--json", "--db", db]) == 0
        return json.loads(out.getvalue())["key"]

    keys = {"alice": create("alice"), "bob": create("bob")}
    engine = AsyncEngine(
        LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256, seed=0, calibrate=False))
    )
    settings = ServerSettings(store_path=":memory:", accounts_path=db)
    with ServerThread(create_app(engine, settings)) as s:
        yield s, keys
    engine.shutdown()


def test_keys_are_needed(keyed):
    server, keys = keyed
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        for path, body in (
            ("/tokenize", {"prompt": TEXT}),
            ("/detokenize", {"tokens": [1, 2]}),
            ("/v1/responses/input_tokens", {"input": TEXT}),
        ):
            assert error(anon.post(path, json=body), 401)["code"] == "invalid_api_key"
            bad = {"Authorization": "Bearer sk-wrong"}
            assert error(anon.post(path, json=body, headers=bad), 401)["code"] == "invalid_api_key"
            good = {"Authorization": f"Bearer {keys['alice']}"}
            assert anon.post(path, json=body, headers=good).status_code == 200, path


def test_input_tokens_sees_only_the_owners_responses(keyed):
    server, keys = keyed
    alice, bob = (
        openai.OpenAI(base_url=server.url + "/v1", api_key=keys[k], max_retries=0)
        for k in ("alice", "bob")
    )
    first = alice.responses.create(model="llama", input="a secret", max_output_tokens=2)
    counted = alice.responses.input_tokens.count(
        model="llama", input="and then?", previous_response_id=first.id
    )
    alone = alice.responses.input_tokens.count(model="llama", input="and then?")
    assert counted.input_tokens > alone.input_tokens
    with pytest.raises(openai.BadRequestError) as theirs:
        bob.responses.input_tokens.count(model="llama", input="x", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as none:
        bob.responses.input_tokens.count(model="llama", input="x", previous_response_id="resp_x")
    assert theirs.value.code == none.value.code == "previous_response_not_found"
    assert theirs.value.body["message"] == none.value.body["message"].replace("resp_x", first.id)
