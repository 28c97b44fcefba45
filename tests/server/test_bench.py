"""`expresslane bench`: metrics on hand-made records, the Poisson schedule, replay files,
retries against a mocked endpoint, and short real runs against the test server (chat over
HTTP, responses over WebSocket with multi-turn sessions, open loop) plus `bench compare`."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
import sys
import time
from pathlib import Path

import httpx
import pytest

from expresslane.bench import metrics
from expresslane.bench.client import send_http
from expresslane.bench.plots import write_plots
from expresslane.bench.records import RequestRecord
from expresslane.bench.replay import load_sessions
from expresslane.bench.runner import Budget, closed_loop, play_session
from expresslane.bench.schedule import poisson_arrivals
from expresslane.bench.synthetic import SyntheticWorkload
from expresslane.bench.target import Target
from expresslane.bench.workloads import Reply, Session, Turn, WorkloadOptions
from expresslane.bench.ws_client import WsTransport
from expresslane.cli import main

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
N_OUT = 6
COMMON = ["--input-tokens", "12", "--output-tokens", str(N_OUT), "--quiet", "--seed", "7"]


# -- metrics on hand-made records --------------------------------------------------------


def hand_records() -> list[RequestRecord]:
    return [
        RequestRecord(
            scheduled=0.0,
            sent=0.1,
            headers=0.3,
            first_token=0.5,
            chunk_times=[0.5, 0.7, 1.0],
            end=1.1,
            input_tokens=10,
            cached_tokens=4,
            output_tokens=3,
            served_tier="default",
            status=200,
        ),
        RequestRecord(
            scheduled=1.0,
            sent=1.0,
            headers=1.1,
            first_token=1.2,
            chunk_times=[1.2, 1.4],
            end=1.4,
            input_tokens=20,
            cached_tokens=0,
            output_tokens=2,
            served_tier="flex",
            status=200,
        ),
        RequestRecord(scheduled=2.0, sent=2.0, end=2.5, status=500, error="HTTP 500", retries=2),
        RequestRecord(
            scheduled=3.0,
            sent=3.0,
            first_token=3.25,
            chunk_times=[3.25],
            end=3.25,
            input_tokens=5,
            output_tokens=1,
            served_tier="flex",
            status=200,
        ),
    ]


def test_metrics_exact_numbers():
    s = metrics.summarize(hand_records(), duration_s=4.0, slo={"ttft": 0.3, "tpot": 0.25})
    approx = lambda x: pytest.approx(x, abs=1e-9)
    assert (s["requests"], s["completed"], s["errors"], s["retries"]) == (4, 3, 1, 2)
    assert s["error_messages"] == {"HTTP 500": 1}
    assert (s["input_tokens"], s["cached_tokens"], s["output_tokens"]) == (35, 4, 6)
    assert s["request_throughput"] == approx(3 / 4)
    assert s["output_throughput"] == approx(6 / 4)
    assert s["total_token_throughput"] == approx(41 / 4)
    # TTFTs 0.5, 0.2, 0.25; E2Es 1.1, 0.4, 0.25; queues 0.1, 0, 0
    assert s["ttft"]["mean"] == approx((0.5 + 0.2 + 0.25) / 3)
    assert s["ttft"]["p50"] == approx(0.25)
    assert s["ttft"]["p90"] == approx(0.25 + 0.8 * 0.25)  # numpy linear interpolation
    assert s["e2e"]["max"] == approx(1.1)
    assert s["queue"]["mean"] == approx(0.1 / 3)
    # TPOT only where output > 1: (1.1 - 0.5) / 2 = 0.3 and (1.4 - 1.2) / 1 = 0.2
    assert s["tpot"]["count"] == 2
    assert s["tpot"]["mean"] == approx(0.25)
    # ITL pools chunk gaps: 0.2, 0.3 and 0.2
    assert s["itl"]["count"] == 3
    assert s["itl"]["p50"] == approx(0.2)
    assert s["itl"]["mean"] == approx(0.7 / 3)
    # per-request tokens/s: 2 / 0.6 and 1 / 0.2
    assert s["per_request_tokens_per_s"]["p50"] == approx((2 / 0.6 + 5) / 2)
    # SLO ttft <= 0.3 and tpot <= 0.25: the 2nd (0.2, 0.2) and the 4th (0.25, one token)
    assert s["goodput"] == approx(2 / 4)
    assert s["slo_attainment"] == approx(2 / 4)
    assert set(s["tiers"]) == {"default", "flex"}
    assert s["tiers"]["flex"]["requests"] == 2
    assert s["tiers"]["flex"]["ttft"]["p50"] == approx(0.225)


def test_metrics_without_slo_or_usage():
    rec = RequestRecord(
        scheduled=0.0, sent=0.0, first_token=0.1, chunk_times=[0.1, 0.2, 0.4], end=0.4
    )
    s = metrics.summarize([rec], duration_s=1.0)
    assert s["goodput"] is None and s["slo_attainment"] is None
    assert s["output_tokens"] == 3  # no usage: the chunk count
    assert s["tpot"]["mean"] == pytest.approx(0.15)
    empty = metrics.summarize([], duration_s=0.0)
    assert empty["request_throughput"] is None and empty["ttft"]["p50"] is None


def test_parse_slo():
    assert metrics.parse_slo("ttft=0.5,tpot=0.05,e2e=10") == {
        "ttft": 0.5,
        "tpot": 0.05,
        "e2e": 10.0,
    }
    assert metrics.parse_slo(None) == {}
    with pytest.raises(ValueError):
        metrics.parse_slo("latency=3")


def test_record_round_trip():
    rec = hand_records()[0]
    again = RequestRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert again == rec


# -- schedule and workloads ---------------------------------------------------------------


def take(it, n: int) -> list[float]:
    return [next(it) for _ in range(n)]


def test_poisson_schedule():
    times = take(poisson_arrivals(4.0, seed=3), 20001)
    assert times[0] == 0.0
    assert times == take(poisson_arrivals(4.0, seed=3), 20001)
    assert times[:50] != take(poisson_arrivals(4.0, seed=4), 50)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 4.0, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.05)
    assert take(poisson_arrivals(math.inf, seed=0), 5) == [0.0] * 5


def test_replay_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"session": "a", "turn": 1, "delay_s": 0.5, "messages": [{"role": "user", "content": "2"}]},
        {"session": None, "input": "alone", "max_tokens": 3},
        {"session": "a", "turn": 0, "input": "1"},
    ]
    path.write_text("# a comment\n" + "\n".join(json.dumps(x) for x in lines) + "\n\n")
    sessions = load_sessions(path, default_max_tokens=9)
    assert [s.id for s in sessions] == ["a", None]
    a = sessions[0]
    assert [t.messages[0]["content"] for t in a.turns] == ["1", "2"]
    assert [t.delay_s for t in a.turns] == [0.0, 0.5]
    assert [t.max_tokens for t in a.turns] == [9, 9]
    assert sessions[1].turns[0].messages == [{"role": "user", "content": "alone"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_sessions(bad, 4)


class FakeTransport:
    """Records what each request carried; replies 'reply N' after a short wait."""

    def __init__(self):
        self.sent: list[list[dict]] = []
        self.sessions = 0

    @contextlib.asynccontextmanager
    async def session(self):
        self.sessions += 1

        async def send(messages, turn, rec, clock):
            self.sent.append(messages)
            rec.sent = clock()
            await asyncio.sleep(0.01)
            rec.first_token = rec.end = clock()
            rec.chunk_times = [rec.end]
            return Reply(f"reply {len(self.sent)}")

        yield send

    async def aclose(self):
        pass


async def test_session_carries_the_conversation():
    user = lambda text: {"role": "user", "content": text}
    session = Session(
        "s",
        [
            Turn([user("a")], 4),
            Turn([user("b")], 4, delay_s=0.05),
            Turn([user("c")], 4, delay_s=0.0),
        ],
    )
    fake = FakeTransport()
    done: list[RequestRecord] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start
    await play_session(fake, session, 2, 0.0, clock, Budget(None, None), done.append)
    assert fake.sent == [
        [user("a")],
        [user("a"), {"role": "assistant", "content": "reply 1"}, user("b")],
    ]  # only the 2 turns granted
    assert fake.sessions == 1
    assert [(r.session, r.turn) for r in done] == [("s", 0), ("s", 1)]
    assert done[1].scheduled >= done[0].end + 0.05


async def test_closed_loop_budget_and_concurrency():
    fake = FakeTransport()
    workload = SyntheticWorkload(WorkloadOptions(seed=1, input_tokens=5))
    done: list[RequestRecord] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start
    await closed_loop(fake, workload.sessions(), 3, Budget(7, None), clock, done.append)
    assert len(done) == len(fake.sent) == 7
    prompts = [m[0]["content"] for m in fake.sent]
    assert len(set(prompts)) == 7 and all(len(p.split()) == 5 for p in prompts)
    # at most 3 in flight at any time
    events = sorted([(r.sent, 1) for r in done] + [(r.end, -1) for r in done])
    in_flight = max(itertools.accumulate(e for _, e in events))
    assert in_flight == 3


async def test_closed_loop_duration():
    fake = FakeTransport()
    workload = SyntheticWorkload(WorkloadOptions(input_tokens=3))
    done: list[RequestRecord] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start
    await closed_loop(fake, workload.sessions(), 2, Budget(None, 0.1), clock, done.append)
    assert all(r.scheduled < 0.1 for r in done)
    # each worker sends at least one; at most about 2 workers x 0.1 s / 10 ms (fewer when busy)
    assert 2 <= len(done) <= 22


# -- retries against a mocked endpoint -----------------------------------------------------


def sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


CHAT_OK = sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "Hel"}}], "service_tier": "flex"},
    {"choices": [{"index": 0, "delta": {"content": "lo"}}], "service_tier": "flex"},
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
    },
)


async def mocked(statuses: list[int], max_retries: int = 3) -> tuple[RequestRecord, str, list]:
    bodies: list = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        status = statuses[min(len(bodies) - 1, len(statuses) - 1)]
        if status != 200:
            return httpx.Response(
                status,
                headers={"retry-after-ms": "5"},
                json={"error": {"message": f"nope {status}"}},
            )
        return httpx.Response(200, content=CHAT_OK, headers={"content-type": "text/event-stream"})

    target = Target(
        "http://bench.test/v1",
        model="m",
        api="chat",
        api_key="k",
        tier="flex",
        max_retries=max_retries,
        extra_body={"ignore_eos": True},
    )
    rec = RequestRecord(scheduled=0.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        clock = iter(range(100)).__next__
        reply = await send_http(
            client,
            target,
            [{"role": "user", "content": "hi"}],
            Turn(messages=[], max_tokens=7),
            rec,
            lambda: float(clock()),
        )
    return rec, reply.text, bodies


async def test_retries_429_then_succeeds():
    rec, text, bodies = await mocked([429, 503, 200])
    assert text == "Hello"
    assert rec.ok and rec.retries == 2 and rec.status == 200
    assert (rec.input_tokens, rec.cached_tokens, rec.output_tokens) == (5, 1, 2)
    assert rec.served_tier == "flex"
    assert len(rec.chunk_times) == 2 and rec.first_token == rec.chunk_times[0]
    body = bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 7 and body["service_tier"] == "flex" and body["ignore_eos"]


async def test_gives_up_and_does_not_retry_client_errors():
    rec, _, bodies = await mocked([429], max_retries=2)
    assert not rec.ok and rec.retries == 2 and rec.status == 429 and len(bodies) == 3
    rec, _, bodies = await mocked([400])
    assert rec.status == 400 and rec.retries == 0 and len(bodies) == 1
    assert rec.error == "HTTP 400: nope 400" and rec.end is not None


# -- real runs against the test server -----------------------------------------------------


def load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def check_run(run: dict, n: int, tier: str | None) -> None:
    s = run["summary"]
    assert s["requests"] == n and s["completed"] == n and s["errors"] == 0, s["error_messages"]
    assert s["output_tokens"] == n * N_OUT
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    for r in run["records"]:
        assert r["error"] is None and r["status"] == 200
        assert r["output_tokens"] == N_OUT  # ignore_eos: exactly max tokens
        assert r["input_tokens"] > 0
        assert r["scheduled"] <= r["sent"] <= r["headers"] <= r["first_token"] <= r["end"]
        assert metrics.ttft(RequestRecord.from_dict(r)) <= metrics.e2e(RequestRecord.from_dict(r))
        assert r["chunk_times"] == sorted(r["chunk_times"]) and len(r["chunk_times"]) >= 1
        assert r["first_token"] == r["chunk_times"][0]
        if tier:
            assert r["served_tier"] == tier
    assert s["ttft"]["p50"] <= s["e2e"]["p50"]
    # A request whose tokens all arrive in one chunk (a busy machine) has no decode time to
    # divide: TPOT counts exactly the streamed ones, and most requests do stream.
    streamed = sum(len(r["chunk_times"]) > 1 for r in run["records"])
    assert s["tpot"]["count"] == streamed and streamed >= n // 2


@pytest.fixture(scope="module")
def chat_run(server, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench_chat")
    rc = main(
        [
            "bench",
            "--base-url",
            server.url,
            "--api",
            "chat",
            "--concurrency",
            "1,2",
            "--requests",
            "6",
            "--tier",
            "flex",
            "--slo",
            "ttft=30,e2e=60",
            "--out",
            str(out),
            *COMMON,
        ]
    )
    assert rc == 0
    return out


def test_closed_loop_chat(chat_run, model_name, server):
    data = load(chat_run)
    assert data["schema_version"] == 1
    meta = data["meta"]
    assert meta["model"] == model_name  # discovered from GET /v1/models
    assert (meta["api"], meta["transport"], meta["tier"], meta["seed"]) == (
        "chat",
        "http",
        "flex",
        7,
    )
    assert meta["command"].startswith("expresslane bench --base-url " + server.url)
    assert [(r["label"], r["concurrency"]) for r in data["runs"]] == [("c=1", 1), ("c=2", 2)]
    for run in data["runs"]:
        check_run(run, 6, "flex")
        assert run["summary"]["slo_attainment"] == 1.0
        assert set(run["summary"]["tiers"]) == {"flex"}
    # closed loop, concurrency 1: each request is scheduled when the previous one ended
    recs = data["runs"][0]["records"]
    assert all(b["scheduled"] >= a["end"] for a, b in zip(recs, recs[1:]))
    # synthetic prompts differ between runs (no prefix-cache hits from an earlier run)
    assert all(
        r["cached_tokens"] < r["input_tokens"] for run in data["runs"] for r in run["records"]
    )
    for name in ("latency_cdf.png", "throughput_vs_speed.png", "tiers.png"):
        if HAVE_MATPLOTLIB:
            assert (chat_run / name).read_bytes().startswith(b"\x89PNG")
            assert (chat_run / name).stat().st_size > 1000
        else:
            assert not (chat_run / name).exists()
    report = (chat_run / "report.md").read_text()
    assert "## c=2" in report and "**TTFT** = first output chunk" in report


@pytest.fixture(scope="module")
def ws_run(server, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bench_ws")
    trace = tmp / "trace.jsonl"
    rows = []
    for s in ("s1", "s2"):
        for turn in range(3):
            text = f"session {s} turn {turn}: list three keys"
            rows.append(
                {
                    "session": s,
                    "turn": turn,
                    "delay_s": 0.05,
                    "input": text,
                    "extra": {"ignore_eos": True},
                }
            )
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp / "out"
    opened = []
    with pytest.MonkeyPatch.context() as mp:
        real = WsTransport.acquire

        async def acquire(self):
            conn = await real(self)
            if conn not in opened:
                opened.append(conn)
            return conn

        mp.setattr(WsTransport, "acquire", acquire)
        rc = main(
            [
                "bench",
                "--base-url",
                server.url + "/v1",
                "--transport",
                "websocket",
                "--workload",
                f"replay:{trace}",
                "--concurrency",
                "2",
                "--out",
                str(out),
                *COMMON,
            ]
        )
    assert rc == 0
    # one socket per session, reused: the warmup's socket and one more for the 2nd session
    assert len(opened) == 2
    return out


def test_websocket_responses_sessions(ws_run):
    data = load(ws_run)
    assert (data["meta"]["api"], data["meta"]["transport"]) == ("responses", "websocket")
    [run] = data["runs"]
    check_run(run, 6, "default")  # no tier asked: the server's default
    by_session: dict = {}
    for r in run["records"]:
        by_session.setdefault(r["session"], []).append(r)
    assert sorted(by_session) == ["s1", "s2"]
    for recs in by_session.values():
        recs.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in recs] == [0, 1, 2]
        for a, b in zip(recs, recs[1:]):
            # the next prompt holds the earlier one (the exact messages, replies included, are
            # checked with a fake transport in test_session_carries_the_conversation)
            assert b["input_tokens"] > a["input_tokens"]
            assert b["scheduled"] >= a["end"] + 0.05  # waited delay_s after the reply


def test_open_loop_rate(server, tmp_path):
    out = tmp_path / "open"
    rc = main(
        [
            "bench",
            "--base-url",
            server.url,
            "--api",
            "responses",
            "--rate",
            "25",
            "--requests",
            "6",
            "--out",
            str(out),
            *COMMON,
        ]
    )
    assert rc == 0
    [run] = load(out)["runs"]
    assert (run["label"], run["rate"]) == ("rate=25", 25.0)
    check_run(run, 6, None)
    expected = take(poisson_arrivals(25.0, seed=7), 6)
    assert [r["scheduled"] for r in run["records"]] == pytest.approx(expected)


def test_compare(chat_run, ws_run, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert (
        main(["bench", "compare", str(chat_run), str(ws_run / "results.json"), "--out", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "c=2" in printed and "B/A" in printed
    md = (out / "compare.md").read_text()
    assert "## c=2" in md and "## c=1" not in md  # only the label both have
    chat, ws = load(chat_run), load(ws_run)
    a_req = chat["runs"][1]["summary"]["request_throughput"]
    b_req = ws["runs"][0]["summary"]["request_throughput"]
    assert f"| req/s | {a_req:,.2f} | {b_req:,.2f} | {b_req / a_req:,.2f} |" in md
    assert (out / "compare_cdf.png").exists() == HAVE_MATPLOTLIB
    # default: next to B
    assert main(["bench", "compare", str(chat_run), str(chat_run)]) == 0
    assert "| 1.00 |" in (chat_run / "compare.md").read_text()


def test_plots_skip_without_matplotlib(chat_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    paths, why = write_plots(tmp_path, load(chat_run))
    assert paths == [] and "matplotlib is not installed" in why
    assert list(tmp_path.iterdir()) == []


def test_bench_needs_base_url():
    with pytest.raises(SystemExit, match="--base-url"):
        main(["bench", "--requests", "1"])
