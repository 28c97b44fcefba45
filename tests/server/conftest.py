"""Server fixtures: real uvicorn servers on 127.0.0.1 (free ports) in background threads.

- `server`: the real engine on the tiny random-weight Llama checkpoint (outputs are gibberish,
  so tests check structure, usage, streaming equality and errors, not content).
- `scripted_server`: the same app over a `ScriptedEngine` that replays fixed text, for
  tool-call paths the random model cannot produce.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.engine.output import RequestOutput
from expresslane.engine.request import RequestMetrics
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings
from expresslane.tokenizer import Tokenizer


class ServerThread:
    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def engine(llama_dir):
    eng = AsyncEngine(
        LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=1024, max_batch=64, seed=0))
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine):
    with ServerThread(create_app(engine, ServerSettings(store_path=":memory:"))) as s:
        yield s


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# Every token is a stop token: generation ends after one token with finish_reason "stop", so
# SDK helpers that insist on a completed response (get_final_*) work with the random model.
STOP_AT_FIRST = {"stop_token_ids": list(range(512))}


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples in an exposition text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- a scripted engine ------------------------------------------------------------------------


@dataclass
class _Req:
    request_id: str


class ScriptedEngine:
    """Replays `reply` (a list of text deltas, one token each) for every request, with the
    real tokenizer for prompt rendering and token counts."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.reply: list[str] = ["Hello", " world"]
        self.finish_reason = "stop"
        self.prompts: list[str] = []
        self.aborted: list[str] = []
        self.crash = False  # submit raises an unexpected exception (a bug)

    def submit(self, prompt, params, request_id=None, priority=0, add_special_tokens=True):
        if self.crash:
            raise RuntimeError("secret internal detail")
        self.prompts.append(prompt)
        n_prompt = (
            len(self.tokenizer.encode(prompt, False)) if isinstance(prompt, str) else len(prompt)
        )
        return self._run(request_id, n_prompt, list(self.reply), self.finish_reason)

    async def _run(self, rid, n_prompt, reply, finish_reason):
        metrics = RequestMetrics(arrival=time.perf_counter())
        for i, piece in enumerate(reply):
            await asyncio.sleep(0)
            last = i == len(reply) - 1
            yield RequestOutput(
                rid, [7], piece, last, finish_reason if last else None, n_prompt, 0, i + 1, metrics
            )

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture(scope="session")
def scripted(llama_dir) -> ScriptedEngine:
    return ScriptedEngine(Tokenizer.from_dir(llama_dir))


@pytest.fixture(scope="session")
def scripted_server(scripted):
    settings = ServerSettings(store_path=":memory:", served_model_name="llama")
    with ServerThread(create_app(scripted, settings)) as s:
        yield s


@pytest.fixture
def scripted_client(scripted_server, scripted) -> openai.OpenAI:
    scripted.reply, scripted.finish_reason, scripted.crash = ["Hello", " world"], "stop", False
    return openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="test", max_retries=0)
