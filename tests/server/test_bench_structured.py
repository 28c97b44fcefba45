"""`expresslane bench` with structured outputs and forced tool calls: short synthetic runs in
each `--response-format` and `--tool-choice` mode against the demo model (Chat over HTTP,
Responses over HTTP and WebSocket), what the server received, the counts in results.json,
report.md and `bench compare`; and the agent's tool_choice per turn, against the demo model
and against a scripted conversation that fixes its task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expresslane.bench.checks import check_output
from expresslane.bench.synthetic import FINDINGS, REPORT_TOOL, TOOLS
from expresslane.bench.workloads import Reply, ToolCall, Turn
from expresslane.cli import main
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread
from .test_bench_agent import fixing_agent, run_agent

REQUESTS = 3
COMMON = ["--input-tokens", "12", "--quiet", "--seed", "3", "--requests", str(REQUESTS)]
GREEDY = ["--extra-body", '{"temperature": 0}']


class BodyRecorder:
    """ASGI middleware keeping the JSON of every POST body and WebSocket message received."""

    def __init__(self, app):
        self.app = app
        self.bodies: list[tuple[str, dict]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "GET":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "websocket.receive" and message.get("text"):
                self.bodies.append((scope["path"], json.loads(message["text"])))
            elif message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append((scope["path"], json.loads(b"".join(chunks) or b"{}")))
            return message

        await self.app(scope, recording_receive, send)

    def take(self) -> list[dict]:
        bodies, self.bodies = [b for _, b in self.bodies], []
        return bodies


@pytest.fixture(scope="module")
def demo():
    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine

    engine = AsyncEngine(LLMEngine(EngineConfig(calibrate=False, num_kv_blocks=512, seed=0)))
    try:
        settings = ServerSettings(store_path=":memory:", served_model_name="demo")
        recorder = BodyRecorder(create_app(engine, settings))
        with ServerThread(recorder) as s:
            yield s.url, recorder
    finally:
        engine.shutdown()


def bench(demo, out: Path, *args: str) -> tuple[dict, list[dict]]:
    """Run `expresslane bench`; its results.json and the bodies the server received."""
    url, recorder = demo
    recorder.take()
    assert main(["bench", "--base-url", url, "--out", str(out), *args]) == 0
    return json.loads((out / "results.json").read_text()), recorder.take()


# (name, bench arguments): the synthetic runs, made once for the module
RUNS = {
    "chat_json_schema": ["--api", "chat", "--response-format", "json_schema", "--concurrency", "2"],
    "responses_json_schema": ["--api", "responses", "--response-format", "json_schema"],
    "chat_json_object": ["--api", "chat", "--response-format", "json_object"],
    "chat_required": ["--api", "chat", "--tool-choice", "required", "--concurrency", "2"],
    "chat_named": ["--api", "chat", "--tool-choice", "named"],
    "ws_named": ["--transport", "websocket", "--tool-choice", "named"],
    "chat_auto": ["--api", "chat", "--tool-choice", "auto"],
}


@pytest.fixture(scope="module")
def runs(demo, tmp_path_factory) -> dict[str, tuple[dict, list[dict], Path]]:
    out = {}
    for name, args in RUNS.items():
        where = tmp_path_factory.mktemp(name)
        data, bodies = bench(demo, where, *args, *COMMON, *GREEDY)
        out[name] = (data, bodies, where)
    return out


def check_timings(run: dict) -> None:
    """Per-request metrics as for free requests: every request has a TTFT, and tokens/s when
    its output came in more than one chunk (the server holds a tool call back until it is
    complete, then sends it whole)."""
    s = run["summary"]
    assert s["completed"] == REQUESTS and s["errors"] == 0, s["error_messages"]
    assert s["ttft"]["count"] == REQUESTS and s["ttft"]["p50"] > 0
    streamed = sum(len(r["chunk_times"]) > 1 for r in run["records"])
    assert s["per_request_tokens_per_s"]["count"] == s["tpot"]["count"] == streamed
    for r in run["records"]:
        assert r["output_tokens"] > 1 and r["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("name", ["chat_json_schema", "responses_json_schema", "chat_json_object"])
def test_structured_runs(runs, name):
    data, bodies, out = runs[name]
    fmt = RUNS[name][3]
    assert data["meta"]["response_format"] == fmt and data["meta"]["tool_choice"] is None
    assert f"--response-format {fmt}" in data["meta"]["command"]
    [run] = data["runs"]
    check_timings(run)
    assert run["summary"]["per_request_tokens_per_s"]["count"] == REQUESTS  # JSON text streams
    checks = run["summary"]["checks"]
    assert checks["schemas_checked"] is True and set(checks["formats"]) == {fmt}
    c = checks["formats"][fmt]
    assert c == checks["structured"]
    # the grammar: every answer that ended by itself is JSON of the schema; the demo model
    # can loop inside a string until the output limit, so some may not end
    assert c["requests"] == REQUESTS and c["valid"] == c["parsed"] >= 1
    assert c["requests"] - c["parsed"] <= c["length"]
    assert c["valid_rate"] == c["valid"] / REQUESTS
    for r in run["records"]:
        assert (r["response_format"], r["tool_choice"]) == (fmt, None)
        assert r["output_check"] == "valid" or r["finish_reason"] == "length"
    # what the server received: the warmup and the run, each asking for the format
    assert len(bodies) == 1 + REQUESTS
    for body in bodies:
        assert "JSON" in json.dumps(body.get("messages") or body.get("input"))
        if name.startswith("responses"):
            assert body["text"]["format"] == {
                "type": "json_schema",
                "name": "findings",
                "schema": FINDINGS,
                "strict": True,
            }
        elif fmt == "json_schema":
            assert body["response_format"] == {
                "type": "json_schema",
                "json_schema": {"name": "findings", "schema": FINDINGS, "strict": True},
            }
        else:
            assert body["response_format"] == {"type": "json_object"}
        assert body["ignore_eos"] is True and "tools" not in body
    report = (out / "report.md").read_text()
    assert f"response_format `{fmt}`" in report
    line = f"Structured outputs ({fmt}): {c['parsed']} of 3 parsed as JSON, {c['valid']} valid, "
    assert line + f"{c['length']} hit the output limit." in report
    assert "| JSON valid % |" not in report  # the summary table keeps the usual columns


@pytest.mark.parametrize("name", ["chat_required", "chat_named", "ws_named", "chat_auto"])
def test_tool_choice_runs(runs, name):
    data, bodies, out = runs[name]
    choice = RUNS[name][3]
    assert data["meta"]["tool_choice"] == choice and data["meta"]["response_format"] is None
    assert data["meta"]["transport"] == ("websocket" if name.startswith("ws") else "http")
    [run] = data["runs"]
    check_timings(run)
    checks = run["summary"]["checks"]
    c = checks["tool_choice"][choice]
    assert c["requests"] == REQUESTS and c["valid"] <= c["tool_calls"]
    if choice != "auto":
        # forced: every reply that ended by itself is one valid call
        assert c["valid"] == c["tool_calls"] >= 1 and c["requests"] - c["tool_calls"] <= c["length"]
        assert checks["forced"]["tool_call_rate"] == c["tool_calls"] / REQUESTS
    else:
        assert "forced" not in checks
    for r in run["records"]:
        assert r["tool_choice"] == choice and r["response_format"] is None
        if choice != "auto":
            assert r["output_check"] == "valid" or r["finish_reason"] == "length"
            assert r["output_check"] != "valid" or r["finish_reason"] == "tool_calls"
    assert len(bodies) == 1 + REQUESTS
    for body in bodies:
        if name.startswith("ws"):
            assert body["type"] == "response.create"
            assert [t["name"] for t in body["tools"]] == [REPORT_TOOL, "search_code"]
            assert body["tool_choice"] == {"type": "function", "name": REPORT_TOOL}
        else:
            assert [t["function"]["name"] for t in body["tools"]] == [REPORT_TOOL, "search_code"]
            assert body["tools"][0]["function"]["parameters"] == FINDINGS
            expected = {"type": "function", "function": {"name": REPORT_TOOL}}
            assert body["tool_choice"] == (expected if choice == "named" else choice)
        assert body["parallel_tool_calls"] is False
    assert f"tool_choice {choice}: " in (out / "report.md").read_text()


def test_compare_shows_the_modes(runs, tmp_path, capsys):
    a, b = runs["chat_json_schema"][2], runs["chat_required"][2]
    assert main(["bench", "compare", str(a), str(b), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "compare.md").read_text()
    assert "response_format json_schema, tool_choice -" in md
    assert "response_format -, tool_choice required" in md
    assert "| JSON valid % | " in md and "| forced: tool call % | – | " in md
    assert "forced: tool call %" in capsys.readouterr().out


def test_bad_combinations():
    with pytest.raises(SystemExit, match="not both"):
        main(["bench", "--base-url", "http://x.test", "--model", "m", "--response-format",
              "json_object", "--tool-choice", "required"])  # fmt: skip
    with pytest.raises(SystemExit, match="synthetic"):
        main(["bench", "--base-url", "http://x.test", "--model", "m", "--workload", "agent",
              "--response-format", "json_object"])  # fmt: skip


def test_check_output():
    schema_turn = Turn([], 8, response_format={"type": "json_schema", "schema": FINDINGS})
    ok = json.dumps({"summary": "s", "findings": []})
    assert check_output(schema_turn, Reply(ok)) == "valid"
    assert check_output(schema_turn, Reply('{"summary": 1}')) == "schema_mismatch"
    assert check_output(schema_turn, Reply('{"summary": ')) == "not_json"
    assert check_output(Turn([], 8, response_format={"type": "json_object"}), Reply("[]")) == (
        "schema_mismatch"
    )
    named = Turn([], 8, tools=TOOLS, tool_choice={"name": REPORT_TOOL})
    call = lambda name, args: Reply("", [ToolCall("c", name, args)])
    assert check_output(named, call(REPORT_TOOL, ok)) == "valid"
    assert check_output(named, call("search_code", '{"query": "x"}')) == "wrong_tool"
    assert check_output(named, call(REPORT_TOOL, '{"summary": "s"}')) == "bad_arguments"
    assert check_output(named, Reply("<tool_call>")) == "no_tool_call"
    required = Turn([], 8, tools=TOOLS, tool_choice="required")
    assert check_output(required, call("search_code", '{"query": "x"}')) == "valid"
    assert check_output(required, call("list_dir", "{}")) == "wrong_tool"
    assert check_output(Turn([], 8, tools=TOOLS), Reply("")) is None  # no tool_choice sent


# -- the agent's tool_choice ---------------------------------------------------------------


def expected_choice(messages: list[dict], mode: str | None) -> str | dict:
    """The agent's rule (agent.py), recomputed from the Chat messages the server received:
    forced until the tests passed after the last write; named: read_file until a file was
    read, run_tests after an untested write; auto: never forced."""
    calls = {
        c["id"]: c["function"]["name"]
        for m in messages
        if m["role"] == "assistant"
        for c in m.get("tool_calls") or []
    }
    has_read = untested = passed = False
    for m in messages:
        if m["role"] != "tool" or m["content"].startswith("error:"):
            continue
        name = calls[m["tool_call_id"]]
        if name == "read_file":
            has_read = True
        elif name == "write_file":
            untested, passed = True, False
        elif name == "run_tests":
            untested, passed = False, m["content"].startswith("exit code 0\n")
    tool = lambda name: {"type": "function", "function": {"name": name}}
    if passed or mode == "auto":
        return "auto"
    if mode == "named" and not has_read:
        return tool("read_file")
    if mode == "named" and untested:
        return tool("run_tests")
    return "required"


@pytest.mark.parametrize("mode", [None, "named"])
def test_agent_tool_choice_against_demo(demo, tmp_path, monkeypatch, mode):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where sandboxes go
    args = ["--workload", "agent:2", "--agent-max-turns", "3", "--output-tokens", "96"]
    args += ["--api", "chat", "--quiet", *GREEDY] + (["--tool-choice", mode] if mode else [])
    data, bodies = bench(demo, tmp_path / "out", *args)
    assert data["meta"]["tool_choice"] == (mode or "required")
    [run] = data["runs"]
    assert run["summary"]["errors"] == 0
    assert len(bodies) == 1 + len(run["records"])  # the warmup, then every turn
    for body in bodies:
        assert body["tool_choice"] == expected_choice(body["messages"], mode)
        assert body["tool_choice"] != "auto"  # the demo model never fixes a task
    forced = run["summary"]["checks"]["forced"]
    assert forced["requests"] == len(run["records"]) and forced["tool_calls"] >= 1
    assert forced["valid"] == forced["tool_calls"]  # the grammar holds calls to their schemas
    assert sum(t["tool_calls"] for t in run["tasks"]) >= forced["tool_calls"]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (None, ["required", "required", "required", "auto"]),
        ("named", ["read_file", "required", "run_tests", "auto"]),
        ("auto", ["auto"] * 4),
    ],
)
def test_agent_tool_choice_per_turn(monkeypatch, tmp_path, mode, expected):
    """Read and test (failing), write, test (passing), answer: forced until the tests pass."""
    args = ["--tool-choice", mode] if mode else []
    data = run_agent(monkeypatch, tmp_path, fixing_agent, *args)
    bodies = data["fake"].bodies[1:]  # 0 is the warmup
    named = lambda c: c["function"]["name"] if isinstance(c, dict) else c
    assert [named(b["tool_choice"]) for b in bodies] == expected
    assert [expected_choice(b["messages"], mode) for b in bodies] == [
        b["tool_choice"] for b in bodies
    ]
    [run] = data["runs"]
    assert [r["tool_choice"] for r in run["records"]] == [
        "named" if e in ("read_file", "run_tests") else e for e in expected
    ]
    assert run["tasks"][0]["accepted"] is True
    checks = run["summary"]["checks"]
    if mode != "auto":
        assert checks["forced"]["requests"] == 3 and checks["forced"]["tool_calls"] == 3
        assert checks["tool_choice"]["auto"] == {
            "requests": 1,
            "tool_calls": 0,
            "valid": 0,
            "length": 0,
            "valid_rate": 0.0,
        }
    else:
        assert "forced" not in checks and checks["tool_choice"]["auto"]["tool_calls"] == 3
