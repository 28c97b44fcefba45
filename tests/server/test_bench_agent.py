"""`expresslane bench --workload agent`: the agent loop against a scripted transport (real tools
in the sandbox, the conversation each turn, the time split, the report and plot), its parts
(tool-call streaming, Responses items, tool-time distributions, code blocks), and short runs
against the test server (whose random model answers in text, so each task is one turn)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from expresslane.bench import runner
from expresslane.bench.agent import code_block
from expresslane.bench.agent_metrics import COMPONENTS
from expresslane.bench.agent_tools import ToolTime
from expresslane.bench.client import send_http
from expresslane.bench.events import StreamReader
from expresslane.bench.records import RequestRecord
from expresslane.bench.sandbox import TASKS_DIR, Sandbox, load_tasks
from expresslane.bench.target import Target
from expresslane.bench.workloads import Reply, ToolCall, Turn
from expresslane.cli import main

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
ORIGINAL = (TASKS_DIR / "sum_range.py").read_text()
FIXED = ORIGINAL.replace("range(a, b)", "range(a, b + 1)")


def call(cid: str, name: str, **args: str) -> ToolCall:
    return ToolCall(cid, name, json.dumps(args))


def fixing_agent(messages: list[dict]) -> Reply:
    """Reads the module and runs the tests, writes the fix, runs the tests, answers."""
    turn = sum(m["role"] == "assistant" for m in messages)
    script = [
        Reply(
            "Let me look.", [call("c1", "read_file", path="sum_range.py"), call("c2", "run_tests")]
        ),
        Reply("", [call("c3", "write_file", path="sum_range.py", content=FIXED)]),
        Reply("", [call("c4", "run_tests")]),
        Reply("Fixed: the range now includes b."),
    ]
    return script[turn]


class ScriptedTransport:
    """Replies from a script of the conversation; keeps each request's messages and body."""

    def __init__(self, script: Callable[[list[dict]], Reply], target: Target):
        self.script = script
        self.target = target
        self.sent: list[list[dict]] = []
        self.bodies: list[dict] = []

    @contextlib.asynccontextmanager
    async def session(self):
        async def send(messages: list[dict], turn: Turn, rec: RequestRecord, clock) -> Reply:
            self.sent.append(messages)
            self.bodies.append(self.target.body(messages, turn))
            rec.sent = clock()
            await asyncio.sleep(0.02)
            rec.headers = rec.first_token = clock()
            await asyncio.sleep(0.01)
            rec.end = clock()
            rec.chunk_times = [rec.first_token, rec.end]
            rec.status, rec.input_tokens, rec.cached_tokens, rec.output_tokens = 200, 50, 20, 5
            return self.script(messages)

        yield send

    async def aclose(self):
        pass


def run_agent(monkeypatch, tmp_path: Path, script, *args: str, api: str = "chat") -> dict:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where sandboxes go
    target = Target("http://fake.test", model="m", api=api)  # type: ignore[arg-type]
    fake = ScriptedTransport(script, target)
    monkeypatch.setattr(runner, "make_transport", lambda t: fake)
    out = tmp_path / "out"
    argv = ["bench", "--base-url", "http://fake.test", "--model", "m", "--api", api, "--quiet"]
    assert main([*argv, "--workload", "agent:1", "--out", str(out), *args]) == 0
    assert not list(tmp_path.glob("expresslane-agent-*"))  # sandboxes removed
    data = json.loads((out / "results.json").read_text())
    data["fake"], data["out"] = fake, out
    return data


def test_agent_fixes_the_bug_with_real_tools(monkeypatch, tmp_path):
    data = run_agent(monkeypatch, tmp_path, fixing_agent)
    [run] = data["runs"]
    [task] = run["tasks"]
    assert (task["task"], task["session"], task["stop"]) == ("sum_range", "sum_range", "answer")
    assert task["accepted"] is True and task["check_output"].strip() == "ok"
    assert (task["turns"], task["tool_calls"]) == (4, 4)
    assert (task["input_tokens"], task["cached_tokens"], task["output_tokens"]) == (200, 80, 20)

    # the conversation sent each turn (the fake's first request is the warmup)
    sent = data["fake"].sent[1:]
    assert [m["role"] for m in sent[0]] == ["system", "user"]
    assert "run_tests()" in sent[0][0]["content"] and "sum_range(a, b)" in sent[0][1]["content"]
    assistant, read, tests = sent[1][2:]
    assert assistant["content"] == "Let me look."
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert assistant["tool_calls"][0]["function"] == {
        "name": "read_file",
        "arguments": '{"path": "sum_range.py"}',
    }
    assert read == {"role": "tool", "tool_call_id": "c1", "content": ORIGINAL}
    assert tests["tool_call_id"] == "c2" and tests["content"].startswith("exit code 1\n")
    assert "AssertionError" in tests["content"]
    assert sent[2][-1] == {
        "role": "tool",
        "tool_call_id": "c3",
        "content": f"wrote {len(FIXED)} characters to sum_range.py",
    }
    assert sent[3][-1]["tool_call_id"] == "c4" and sent[3][-1]["content"] == "exit code 0\nok\n"
    assert all(a == b[: len(a)] for a, b in zip(sent, sent[1:]))  # each extends the last
    body = data["fake"].bodies[1]
    assert [t["function"]["name"] for t in body["tools"]] == [
        "read_file",
        "write_file",
        "run_tests",
    ]
    assert "ignore_eos" not in body and body["max_tokens"] == 1024

    # the time split adds up to the task time, each part from its own measurements
    recs = [r for r in run["records"] if r["session"] == "sum_range"]
    assert [r["turn"] for r in recs] == [0, 1, 2, 3]
    assert task["task_s"] == pytest.approx(task["end"] - task["start"])
    assert sum(task[k] for k in COMPONENTS) == pytest.approx(task["task_s"])
    assert task["queue_prompt_s"] == pytest.approx(sum(r["first_token"] - r["sent"] for r in recs))
    assert task["generation_s"] == pytest.approx(sum(r["end"] - r["first_token"] for r in recs))
    assert task["tool_s"] > 0.01 and task["verification_s"] > 0.01  # python subprocesses
    assert 0 <= task["client_overhead_s"] < task["task_s"] / 2
    gaps = sum(b["scheduled"] - a["end"] for a, b in zip(recs, recs[1:]))
    assert task["tool_s"] <= gaps + 1e-6  # tools ran between the requests

    agent = run["summary"]["agent"]
    assert (agent["tasks"], agent["verified"], agent["accepted"]) == (1, 1, 1)
    assert agent["acceptance_rate"] == 1.0 and agent["stops"] == {"answer": 1}
    assert agent["tool_s"]["total"] == pytest.approx(task["tool_s"])
    assert agent["turns"]["p50"] == 4
    report = (data["out"] / "report.md").read_text()
    assert "Agent tasks: 1 (answer 1); accepted 1 of 1 verified (100.0%)" in report
    assert "| queue + prompt |" in report and "**client overhead**" in report
    plot = data["out"] / "task_breakdown.png"
    assert plot.exists() == HAVE_MATPLOTLIB
    if HAVE_MATPLOTLIB:
        assert plot.read_bytes().startswith(b"\x89PNG") and plot.stat().st_size > 1000


def test_agent_responses_items(monkeypatch, tmp_path):
    data = run_agent(monkeypatch, tmp_path, fixing_agent, api="responses")
    assert data["runs"][0]["tasks"][0]["accepted"] is True
    items = data["fake"].bodies[3]["input"]  # the 3rd turn (0 is the warmup)
    assert [i.get("type") or i["role"] for i in items] == [
        "system",
        "user",
        "assistant",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "function_call",
        "function_call_output",
    ]
    assert items[3] == {
        "type": "function_call",
        "call_id": "c1",
        "name": "read_file",
        "arguments": '{"path": "sum_range.py"}',
    }
    assert items[5] == {"type": "function_call_output", "call_id": "c1", "output": ORIGINAL}
    assert items[8]["call_id"] == "c3"
    tools = data["fake"].bodies[2]["tools"]
    assert tools[0]["type"] == "function" and tools[0]["name"] == "read_file"


def test_agent_code_block_patch_and_max_turns(monkeypatch, tmp_path):
    patch = lambda messages: Reply(f"Here:\n```python\n{FIXED}```\nDone.")
    [task] = run_agent(monkeypatch, tmp_path, patch)["runs"][0]["tasks"]
    assert (task["stop"], task["accepted"], task["turns"], task["tool_calls"]) == (
        "patch",
        True,
        1,
        0,
    )
    looping = lambda messages: Reply("", [call("x", "read_file", path="../../etc/passwd")])
    data = run_agent(monkeypatch, tmp_path, looping, "--agent-max-turns", "2")
    [task] = data["runs"][0]["tasks"]
    assert (task["stop"], task["accepted"], task["turns"], task["tool_calls"]) == (
        "max_turns",
        False,
        2,
        2,
    )
    assert "outside the project" in data["fake"].sent[-1][-1]["content"]


def test_agent_simulated_tool_time(monkeypatch, tmp_path):
    data = run_agent(monkeypatch, tmp_path, fixing_agent, "--tool-time", "const:0.05")
    [task] = data["runs"][0]["tasks"]
    assert task["accepted"] is None and task["tool_calls"] == 4
    assert 0.2 <= task["tool_s"] < 0.4  # four calls of 0.05 s
    sent = data["fake"].sent[1:]
    assert sent[1][3]["content"] == ORIGINAL  # canned read_file: the task's file
    assert "simulated" in sent[1][4]["content"] and "simulated" in sent[3][-1]["content"]
    assert data["runs"][0]["summary"]["agent"]["acceptance_rate"] is None
    assert "--tool-time const:0.05" in data["meta"]["command"]
    out, cmp = data["out"], tmp_path / "cmp"
    assert main(["bench", "compare", str(out), str(out), "--out", str(cmp)]) == 0
    md = (cmp / "compare.md").read_text()
    assert "| agent tasks | 1 | 1 | 1.00 |" in md and "| tools s/task |" in md
    assert (cmp / "compare_task_breakdown.png").exists() == HAVE_MATPLOTLIB


def test_tool_time_distributions():
    rng = lambda: random.Random(3)
    assert ToolTime.parse("const:1.5").sample(rng()) == 1.5
    for spec in ("uniform:0.5,1", "exp:0.5", "lognormal:0.5,0.8"):
        tt = ToolTime.parse(spec)
        xs = [tt.sample(r) for r in [rng()] for _ in range(2000)]
        assert xs[:5] == [tt.sample(r) for r in [rng()] for _ in range(5)]  # seeded
        assert all(x >= 0 for x in xs)
    xs = sorted(ToolTime.parse("lognormal:0.5,0.8").sample(r) for r in [rng()] for _ in range(2001))
    assert xs[1000] == pytest.approx(0.5, rel=0.1)  # the median
    for bad in ("lognormal:1", "gauss:1,2", "const:-1", "uniform:a,b"):
        with pytest.raises(ValueError, match="--tool-time"):
            ToolTime.parse(bad)


def test_code_block():
    assert code_block("no code") is None
    assert code_block("```python\na = 1\n```\n```py\nb = 2\n```") == "b = 2\n"
    assert code_block("```\nc = 3\n```") == "c = 3\n"


def test_stream_reader_tool_calls():
    rec = RequestRecord(0.0)
    chat = StreamReader(rec, "chat")
    fn = lambda **kw: {"choices": [{"index": 0, "delta": {"tool_calls": [kw]}}]}
    chat.feed({"choices": [{"index": 0, "delta": {"content": "Hm."}}]}, 1.0)
    chat.feed(fn(index=0, id="a", function={"name": "read_file", "arguments": '{"pa'}), 2.0)
    chat.feed(fn(index=0, function={"arguments": 'th": "x"}'}), 3.0)
    chat.feed(fn(index=1, id="b", function={"name": "run_tests", "arguments": "{}"}), 4.0)
    assert chat.reply == Reply(
        "Hm.", [ToolCall("a", "read_file", '{"path": "x"}'), ToolCall("b", "run_tests", "{}")]
    )
    assert rec.chunk_times == [1.0, 2.0, 3.0, 4.0]
    item = {"type": "function_call", "call_id": "k", "name": "run_tests", "arguments": "{}"}
    resp = StreamReader(RequestRecord(0.0), "responses")
    resp.feed({"type": "response.output_item.done", "item": item}, 1.0)
    resp.feed({"type": "response.output_item.done", "item": {"type": "message"}}, 1.0)
    resp.feed({"type": "response.completed", "response": {"output": [item, item]}}, 2.0)
    assert resp.done and resp.reply.tool_calls == [ToolCall("k", "run_tests", "{}")]
    late = StreamReader(RequestRecord(0.0), "responses")  # only in the final response
    late.feed({"type": "response.completed", "response": {"output": [item]}}, 2.0)
    assert late.reply.tool_calls == [ToolCall("k", "run_tests", "{}")]


async def test_bundled_tasks_fail_as_shipped():
    tasks = load_tasks()
    assert len(tasks) == 6 and len({t.id for t in tasks}) == 6
    for t in tasks:
        assert t.module in t.files
        box = Sandbox(t)
        try:
            code, output = await box.check()
            assert code == 1 and "AssertionError" in output, (t.id, output)
        finally:
            box.close()
        assert not box.dir.exists()


# -- against the test server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_server(llama_dir):
    """The test server's random model with room for the agent's tools, which its template does
    not render: the server writes them into the system message (server/tool_prompt.py)."""
    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine
    from expresslane.server.app import create_app
    from expresslane.server.settings import ServerSettings

    from .conftest import ServerThread

    config = EngineConfig(model=str(llama_dir), max_model_len=4096, num_kv_blocks=1024, seed=0)
    engine = AsyncEngine(LLMEngine(config))
    try:
        with ServerThread(create_app(engine, ServerSettings(store_path=":memory:"))) as s:
            yield s
    finally:
        engine.shutdown()


def test_agent_against_server(wide_server, tmp_path, monkeypatch):
    server = wide_server
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "out"
    common = ["--base-url", server.url, "--output-tokens", "4", "--quiet", "--out", str(out)]
    assert (
        main(["bench", *common, "--api", "chat", "--workload", "agent", "--concurrency", "3"]) == 0
    )
    data = json.loads((out / "results.json").read_text())
    [run] = data["runs"]
    tasks = run["tasks"]
    assert sorted(t["task"] for t in tasks) == sorted(t.id for t in load_tasks())
    for t in tasks:
        # the random model answers in text: one turn, then the unchanged module fails its check
        assert t["stop"] in ("answer", "patch") and t["turns"] == 1 and t["accepted"] is False
        assert "AssertionError" in t["check_output"] and t["verification_s"] > 0
        assert t["input_tokens"] > 0 and t["output_tokens"] > 0
        assert sum(t[k] for k in COMPONENTS) == pytest.approx(t["task_s"])
    assert run["summary"]["completed"] == 6 and run["summary"]["agent"]["acceptance_rate"] == 0
    assert (out / "task_breakdown.png").exists() == HAVE_MATPLOTLIB
    assert not list(tmp_path.glob("expresslane-agent-*"))
    # Responses over WebSocket, tools included in the request
    ws = tmp_path / "ws"
    args = ["--transport", "websocket", "--workload", "agent:2", "--out", str(ws)]
    assert main(["bench", *common[:-2], *args]) == 0
    [run] = json.loads((ws / "results.json").read_text())["runs"]
    assert [t["turns"] for t in run["tasks"]] == [1, 1] and run["summary"]["errors"] == 0


# Slow alone (the fixture trains its model, minutes on a busy CPU); in a full run with -m slow
# the fixture is shared with test_tool_calls.py.
@pytest.mark.slow
async def test_reply_tool_calls_from_tool_server(tool_server):
    """The tool-trained model's real streams (Chat and Responses) give the calls back."""
    spec = {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }  # as the model was trained (tests/server/conftest.py)
    turn = Turn([], max_tokens=64, tools=[spec], extra={"temperature": 0})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    async with httpx.AsyncClient() as client:
        for api in ("chat", "responses"):
            target = Target(tool_server.url, model="llama", api=api)  # type: ignore[arg-type]
            rec = RequestRecord(0.0)
            reply = await send_http(client, target, messages, turn, rec, lambda: 0.0)
            assert rec.ok, rec.error
            [c] = reply.tool_calls
            assert (c.name, json.loads(c.arguments)) == ("get_weather", {"city": "Paris"})
            assert c.id and rec.first_token is not None
