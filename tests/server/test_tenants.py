"""Tenant isolation of stored responses: a real server with real API keys (made with the
`expresslane keys` command) and a real SQLite store. Another owner's response answers exactly as
an id that does not exist (404, or 400 `previous_response_not_found`), over HTTP and WebSocket,
for finished responses in the store and for background jobs still running in memory; keys
created under one name share their responses."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import secrets

import httpx
import openai
import pytest
import websockets

from expresslane.cli import main as cli
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread

MODEL = "llama"
SHORT = {"max_output_tokens": 4, "temperature": 0}


def make_key(db: str, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["keys", "create", name, "--json", "--db", db]) == 0
    return json.loads(out.getvalue())["key"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[str, dict[str, str]]:
    db = str(tmp_path_factory.mktemp("tenants") / "accounts.sqlite")
    return db, {
        "alice": make_key(db, "alice"),
        "alice2": make_key(db, "alice"),  # a second key under the same name
        "bob": make_key(db, "bob"),
    }


@pytest.fixture(scope="module")
def server(llama_dir, keys, tmp_path_factory):
    db, _ = keys
    store = str(tmp_path_factory.mktemp("tenants_store") / "responses.sqlite")
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=512, seed=0)))
    with ServerThread(create_app(engine, ServerSettings(store_path=store, accounts_path=db))) as s:
        yield s
    engine.shutdown()


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def http(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def fake_id() -> str:
    return "resp_" + secrets.token_hex(12)


def probes(rid: str) -> list[tuple[str, str, dict]]:
    """(method, path, params) of every request that reaches a response by id."""
    base = f"/v1/responses/{rid}"
    return [
        ("GET", base, {}),
        ("GET", base + "/input_items", {}),
        ("POST", base + "/cancel", {}),
        ("GET", base, {"stream": "true"}),
        ("DELETE", base, {}),
    ]


def assert_as_if_absent(c: httpx.Client, rid: str) -> None:
    """Each probe of `rid` answers exactly as the same probe of an id that does not exist."""
    other = fake_id()
    for (method, path, params), (_, fake_path, _) in zip(probes(rid), probes(other), strict=True):
        got = c.request(method, path, params=params)
        want = c.request(method, fake_path, params=params)
        assert got.status_code == want.status_code == 404, (method, path, got.text)
        assert got.json() == json.loads(want.text.replace(other, rid))
        assert got.json()["error"]["code"] == "response_not_found"


def continue_from(c: httpx.Client, rid: str) -> httpx.Response:
    body = {"model": MODEL, "input": "and then?", "previous_response_id": rid, **SHORT}
    return c.post("/v1/responses", json=body)


def test_another_key_cannot_reach_a_stored_response(server, keys):
    _, k = keys
    alice = sdk(server, k["alice"])
    r = alice.responses.create(model=MODEL, input="secret input text", **SHORT)
    with http(server, k["bob"]) as bob:
        assert_as_if_absent(bob, r.id)
        other = fake_id()
        got, want = continue_from(bob, r.id), continue_from(bob, other)
        assert got.status_code == want.status_code == 400
        assert got.json() == json.loads(want.text.replace(other, r.id))
        assert got.json()["error"]["code"] == "previous_response_not_found"
    # the owner still has it all, untouched by the other key's DELETE and cancel
    assert alice.responses.retrieve(r.id).output_text == r.output_text
    items = alice.responses.input_items.list(r.id)
    assert items.data[0].content[0].text == "secret input text"
    follow = alice.responses.create(
        model=MODEL, input="and then?", previous_response_id=r.id, **SHORT
    )
    assert follow.previous_response_id == r.id
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)


def test_another_key_cannot_reach_a_background_job_in_memory(server, keys):
    _, k = keys
    alice = sdk(server, k["alice"])
    job = alice.responses.create(
        model=MODEL,
        input="hi",
        background=True,
        max_output_tokens=480,
        extra_body={"ignore_eos": True},
    )
    with http(server, k["bob"]) as bob:
        assert_as_if_absent(bob, job.id)
    # the other key's cancel and DELETE did nothing: the owner still has it and resumes it
    assert alice.responses.retrieve(job.id).status != "cancelled"
    with (
        http(server, k["alice"]) as mine,
        mine.stream("GET", f"/v1/responses/{job.id}", params={"stream": "true"}) as s,
    ):
        assert s.status_code == 200
        types = [json.loads(ln[6:])["type"] for ln in s.iter_lines() if ln.startswith("data: {")]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert alice.responses.retrieve(job.id).usage.output_tokens == 480


def test_keys_under_one_name_share_their_responses(server, keys):
    _, k = keys
    r = sdk(server, k["alice"]).responses.create(model=MODEL, input="shared", **SHORT)
    twin = sdk(server, k["alice2"])
    assert twin.responses.retrieve(r.id).output_text == r.output_text
    follow = twin.responses.create(model=MODEL, input="more", previous_response_id=r.id, **SHORT)
    assert follow.previous_response_id == r.id
    twin.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        sdk(server, k["alice"]).responses.retrieve(r.id)


def test_websocket_previous_response_id_is_the_owners_only(server, keys):
    _, k = keys
    r = sdk(server, k["alice"]).responses.create(model=MODEL, input="ws", **SHORT)
    url = server.url.replace("http", "ws") + "/v1/responses"

    async def ask(key: str, rid: str) -> dict:
        headers = {"Authorization": f"Bearer {key}"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            create = {"type": "response.create", "model": MODEL, "input": "go", **SHORT}
            await ws.send(json.dumps({**create, "previous_response_id": rid}))
            done = ("response.completed", "response.incomplete", "error")
            while (event := json.loads(await ws.recv()))["type"] not in done:
                pass
            return event

    other = fake_id()
    got = asyncio.run(ask(k["bob"], r.id))
    want = asyncio.run(ask(k["bob"], other))
    assert got["type"] == "error" and got["status"] == 400
    assert got == json.loads(json.dumps(want).replace(other, r.id))
    assert got["error"]["code"] == "previous_response_not_found"
    mine = asyncio.run(ask(k["alice2"], r.id))
    assert mine["type"] in ("response.completed", "response.incomplete")
    assert mine["response"]["previous_response_id"] == r.id


def test_a_store_file_from_before_owners_opens_with_its_rows_local(tmp_path):
    import sqlite3

    from expresslane.server.keys import LOCAL_OWNER
    from expresslane.server.store import SCHEMA, ResponseStore

    path = str(tmp_path / "old.sqlite")
    old = sqlite3.connect(path)
    old.execute(SCHEMA)  # the table as it was: no origin columns
    response = {"id": "resp_old", "status": "completed", "output": []}
    old.execute(
        "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
        ("resp_old", 1.0, 1.0, "completed", json.dumps(response), "[]", "[]"),
    )
    old.commit()
    old.close()
    store = ResponseStore(path)
    try:
        assert store.get("resp_old", LOCAL_OWNER).response == response
        assert store.get("resp_old", "key:bob") is None
        assert not store.delete("resp_old", "key:bob")
        assert store.delete("resp_old", LOCAL_OWNER)
        assert store.get("resp_old") is None
    finally:
        store.close()
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM responses").fetchone() == (0,)
