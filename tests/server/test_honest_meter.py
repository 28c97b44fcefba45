"""The meter measures the server, not the client, and no key takes a lane from the others:
through a real server, with real keys, raw sockets and the openai SDK.

- A client that stops reading is judged and billed on the engine's own times and counts: its
  ledger row is written while it has read nothing, kept, and billed for every token, also
  when it then hangs up; a client that hangs up mid-answer is billed for what the engine made.
- Admission counts generations (`n` times prompts), reserved before tokenization: a request
  larger than a bound is a 400 at once, a key past its share of ultrafast a 429, and another
  key is still admitted."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from expresslane.lanes import build_lanes
from expresslane.promise import Stated
from expresslane.server.accounts import Accounts
from expresslane.server.app import create_app
from expresslane.server.keys import ApiKey, Plan
from expresslane.server.metering import Prices
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread, known_costs_engine
from .test_accounts import ledger, run_cli

# A promise any machine keeps: the slow reader's row must say kept.
LANES = {
    "ultrafast": {
        "max_batch": 4,
        "speculative": False,
        "promise": {"tokens_per_s": 0.01, "ttft_s": 1000.0},
    }
}
FOREVER = {"ignore_eos": True}


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("meter") / "accounts.sqlite")


@pytest.fixture(scope="module")
def keys(db) -> dict[str, str]:
    both = ["--tiers", "ultrafast,default", "--default-tier", "ultrafast"]
    names = ("slow", "gone", "a", "b", "burst")
    return {
        name: json.loads(run_cli("keys", "create", name, *both, "--json", "--db", db))["key"]
        for name in names
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = known_costs_engine(tmp_path_factory.mktemp("long"), LANES)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine, db, keys):
    settings = ServerSettings(store_path=":memory:", accounts_path=db, max_in_flight_per_key=6)
    with ServerThread(create_app(engine, settings)) as s:
        yield s


def key_id(db: str, name: str) -> str:
    keys = json.loads(run_cli("keys", "list", "--json", "--db", db))
    return next(k["id"] for k in keys if k["name"] == name)


def rows_of(db: str, name: str) -> list[dict]:
    mine = key_id(db, name)
    return [r for r in ledger(db) if r["key_id"] == mine]


def wait_for(condition, seconds: float = 300.0, what: str = "the condition"):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def slow_socket(server, key: str, body: dict) -> socket.socket:
    """A stream request sent on a socket with a tiny receive buffer, nothing read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def chat(max_tokens: int) -> dict:
    # 20 alternatives per token: the stream is megabytes, far more than the socket buffers
    return {
        "model": "llama",
        "messages": [{"role": "user", "content": "go"}],
        "stream": True,
        "max_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": 20,
        **FOREVER,
    }


def test_a_slow_reader_is_judged_and_billed_on_the_engine(server, engine, db, keys):
    sock = slow_socket(server, keys["slow"], chat(1500))
    try:
        (row,) = wait_for(lambda: rows_of(db, "slow"), what="the row, the client reading nothing")
        assert (row["status"], row["output_tokens"]) == ("length", 1500)
        assert row["promise_kept"] == 1 and row["refund"] == 0.0
        assert row["tier_served"] == "ultrafast" and row["cost"] > 0
        assert sock.recv(1)  # the answer is still waiting for its reader
    finally:
        sock.close()  # and it hangs up before reading it
    wait_for(lambda: engine.lane_load("ultrafast") == 0, what="the hang-up")
    assert [r["output_tokens"] for r in rows_of(db, "slow")] == [1500]  # billed once, in full


def test_a_client_that_hangs_up_is_billed_for_what_the_engine_made(server, engine, db, keys):
    sock = slow_socket(server, keys["gone"], chat(3000))
    try:
        wait_for(lambda: sock.recv(1), what="the first byte")
        running = wait_for(lambda: list(engine.engine.requests.values()), what="the request")
        (req,) = running
        wait_for(lambda: req.num_output_tokens >= 400, what="400 tokens made")
        made = req.num_output_tokens  # far more than the few the client could have read
    finally:
        sock.close()
    (row,) = wait_for(lambda: rows_of(db, "gone"), what="the abort's row")
    assert row["status"] == "abort"
    assert made <= row["output_tokens"] <= req.num_output_tokens < 3000


def test_generations_are_counted_and_a_key_keeps_to_its_share(server, keys):
    a = openai.OpenAI(base_url=server.url + "/v1", api_key=keys["a"], max_retries=0)
    b = openai.OpenAI(base_url=server.url + "/v1", api_key=keys["b"], max_retries=0)
    prompts = [[5, 6, 7 + i] for i in range(48)]
    with pytest.raises(openai.BadRequestError) as e:
        a.completions.create(model="llama", prompt=prompts, n=16, max_tokens=4)
    assert e.value.code == "too_many_generations"

    streams = [
        a.completions.create(
            model="llama", prompt=[5, 6, 7], max_tokens=4000, stream=True, extra_body=FOREVER
        )
        for _ in range(4)  # half of ultrafast's queue (4 running + 4 waiting); 2 of them run
    ]
    try:
        with pytest.raises(openai.RateLimitError) as e:
            a.completions.create(model="llama", prompt=[5, 6], max_tokens=2)
        assert e.value.code == "lane_share_exceeded"
        assert e.value.response.headers["retry-after"] == "1"
        got = b.completions.create(model="llama", prompt=[5, 6], max_tokens=2)
        assert got.service_tier == "ultrafast" and got.usage.completion_tokens == 2
    finally:
        for s in streams:
            s.close()


def test_concurrent_requests_cannot_all_pass_one_check(server, engine, db, keys):
    """Six in flight per key: of ten concurrent requests whose large prompts are tokenized off
    the event loop, at most six are admitted (the check and the reservation are one step)."""
    big = "and the " * 1100  # 8,800 characters, 2,202 tokens

    async def one(c: httpx.AsyncClient) -> int:
        body = {"model": "llama", "prompt": big, "max_tokens": 900, **FOREVER}
        body["service_tier"] = "default"
        r = await c.post("/v1/completions", json=body)
        return r.status_code

    async def burst() -> list[int]:
        headers = {"authorization": f"Bearer {keys['burst']}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300) as c:
            return await asyncio.gather(*(one(c) for _ in range(10)))

    codes = asyncio.run(burst())
    assert sorted(codes) == [200] * 6 + [429] * 4


def _accounts(tmp_path) -> tuple[Accounts, ApiKey]:
    accounts = Accounts(str(tmp_path / "a.sqlite"), Prices(), build_lanes(LANES))
    plan = Plan(tiers=["ultrafast", "default"], default_tier="ultrafast")
    key, _ = accounts.keys.create("k", plan)
    return accounts, key


def _finish(accounts: Accounts, ticket, rid: str, status="stop", ttft_s=5.0, output_tokens=8):
    timings = {"queue_s": 0.0, "ttft_s": ttft_s, "decode_s": 1.0, "e2e_s": 6.0}
    return accounts.finish(
        ticket,
        rid,
        "m",
        status=status,
        input_tokens=4,
        cached_tokens=0,
        output_tokens=output_tokens,
        estimated_tokens=12,
        timings=timings,
    )


def test_a_first_token_missed_on_its_own_account_is_not_refunded(tmp_path):
    """ultrafast runs 4, a key 2 of them: its third request waits behind its own work, and a
    request its `queue` policy placed on a lane without room waits by its own choice."""
    accounts, key = _accounts(tmp_path)
    promise = Stated(1000.0, 0.5, 1000, 0.5, 8, 50, 300)
    tickets = [accounts.admit(key, "ultrafast", lambda lane: 0, lambda lane: True) for _ in "abc"]
    queued = accounts.admit(key, "ultrafast", lambda lane: 0, lambda lane: False)
    for t in (*tickets, queued):
        t.promise = promise
    assert [t.no_refund for t in tickets] == [None, None, "own_backlog"]
    rows = [_finish(accounts, t, f"r{i}") for i, t in enumerate((*tickets, queued))]
    assert [r.missed for r in rows] == ["ttft"] * 4
    assert [r.refund > 0 for r in rows] == [True, True, False, False]
    assert [r.refund_withheld for r in rows] == [None, None, "own_backlog", "own_backlog"]
    late = accounts.admit(key, "ultrafast", lambda lane: 0, lambda lane: False)
    late.promise = promise
    assert late.no_refund == "queued_without_room"  # its key's others have ended
    slow = _finish(accounts, late, "r9", ttft_s=0.1, output_tokens=100)  # 99 tokens in 1 s
    assert (slow.missed, slow.refund_withheld) == ("speed", None) and slow.refund > 0


def test_an_error_after_tokens_is_billed_for_them_and_an_id_once(tmp_path):
    accounts, key = _accounts(tmp_path)
    ticket = accounts.admit(key, "default", lambda lane: 0, lambda lane: True, generations=2)
    assert accounts.in_flight.key(key.id) == 2
    failed = _finish(accounts, ticket, "e1", status="error", output_tokens=7)
    assert failed.cost > 0
    nothing = _finish(accounts, ticket, "e2", status="error", output_tokens=0)
    assert nothing.cost == 0.0 and accounts.in_flight.key(key.id) == 0
    again = accounts.admit(key, "default", lambda lane: 0, lambda lane: True)
    _finish(accounts, again, "e1", status="stop")  # the same id again: not billed twice
    assert [r["request_id"] for r in accounts.ledger.rows()] == ["e1", "e2"]
