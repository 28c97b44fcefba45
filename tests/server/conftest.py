"""Server fixtures: real uvicorn servers on 127.0.0.1 (free ports) in background threads.

- `server`: the real engine on the tiny random-weight Llama checkpoint (outputs are gibberish,
  so tests check structure, usage, streaming equality and errors, not content).
- `tool_server`: the same app over the real engine on a tiny Llama (with the demo tokenizer
  and its tool-calling chat template) overfit in the session to answer the tool tests'
  prompts with fixed replies: tool calls, malformed calls, plain text.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

import expresslane
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.prompt import render, template_tools
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


# -- a real checkpoint trained to write tool calls -------------------------------------------

DEMO_TOKENIZER = Path(expresslane.__file__).parent / "assets" / "demo" / "target"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
TWO_CALLS = (
    "I'll check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
ROME_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Trained without an end token: requests cap it with max tokens, so it ends with "length".
MALFORMED = 'Sure: <tool_call>\n{"name": "get_weather", "arguments": {"ci'


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _paris_turn(content: str | None) -> list[dict]:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "content": "18C"},
    ]


# (messages, with tools, forced start, reply, ends with the end token): the exact prompts the
# tool tests send (rendered by the server's own `render`) and what the model must answer; the
# forced start is output the grammar leaves the model no choice about.
TOOL_SCRIPT = [
    ([_user("hi")], False, "", "Hello", True),
    ([_user("Weather?")], True, "", TWO_CALLS, True),
    ([_user("Weather in Paris?")], True, "", PARIS_CALL, True),
    ([_user("Weather in Paris?"), *_paris_turn("")], True, "", "It is sunny.", True),
    ([_user("x")], True, "", MALFORMED, False),
    # a forced call (tool_choice required or named): the grammar makes <tool_call> the first token
    ([_user("x")], True, "<tool_call>", ROME_CALL.removeprefix("<tool_call>"), True),
    ([_user("Weather there?"), *_paris_turn(None)], True, "", "Done.", True),
    ([_user("Weather here?")], True, "", "Checking." + PARIS_CALL, True),
    ([_user("Weather here?"), *_paris_turn("Checking.")], True, "", "Sunny.", True),
]


def _train_tool_model(out: Path) -> None:
    """Overfit a tiny Llama on TOOL_SCRIPT until every reply token wins by a wide margin, so
    that greedy decoding and sampling at temperature 1 both reproduce the replies."""
    import transformers

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TOKENIZER / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = Tokenizer.from_dir(out)
    tools = template_tools([WEATHER])
    seqs = []
    for messages, with_tools, prefix, reply, eos in TOOL_SCRIPT:
        prompt = tok.encode(render(tok, messages, tools if with_tools else None) + prefix)
        target = tok.encode(reply, False) + ([2] if eos else [])
        seqs.append((prompt + target, len(prompt)))
    width = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (s, n) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, n : len(s)] = torch.tensor(s[n:])
        mask[i, : len(s)] = 1
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scored = labels[:, 1:] != -100
    gold = labels[:, 1:][scored][:, None]
    for _ in range(400):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[:, :-1][scored])  # only where a reply token is predicted
        with torch.no_grad():
            others = logits.scatter(1, gold, float("-inf")).max(1).values
            margin = (logits.gather(1, gold)[:, 0] - others).min().item()
        if margin > 2:  # measured on the weights being saved
            break
        opt.zero_grad()
        torch.nn.functional.cross_entropy(logits, gold[:, 0]).backward()
        opt.step()
    else:
        raise RuntimeError(f"the tool model did not learn its script (margin {margin:.2f})")
    # Sharpen: scaling the final norm scales every logit, so each reply token's lead over the
    # runner-up becomes >= 40 and sampling at the default temperature 1 picks it too.
    with torch.no_grad():
        model.model.norm.weight.mul_(40 / margin)
    model.eval().save_pretrained(out)


class RecordingEngine(AsyncEngine):
    """The real engine, keeping the prompts it was given (to check prompt rendering)."""

    def __init__(self, engine: LLMEngine):
        super().__init__(engine)
        self.prompts: list = []

    def make_request(self, sub):
        self.prompts.append(sub.prompt)
        return super().make_request(sub)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tool_llama")
    _train_tool_model(out)
    return out


@pytest.fixture(scope="session")
def tool_engine(tool_model_dir):
    eng = RecordingEngine(
        LLMEngine(EngineConfig(model=str(tool_model_dir), dtype="float32", num_kv_blocks=256))
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def tool_server(tool_engine):
    settings = ServerSettings(store_path=":memory:", served_model_name="llama")
    with ServerThread(create_app(tool_engine, settings)) as s:
        yield s


@pytest.fixture(scope="session")
def tool_client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="test", max_retries=0)


@pytest.fixture(scope="session")
def smollm2_server(smollm2_hf):
    """A server on SmolLM2-135M-Instruct, served as "smollm2" (real model tests, any API)."""
    config = EngineConfig(model=str(smollm2_hf), calibrate=False, num_kv_blocks=512, seed=0)
    engine = AsyncEngine(LLMEngine(config))
    try:
        settings = ServerSettings(store_path=":memory:", served_model_name="smollm2")
        with ServerThread(create_app(engine, settings)) as s:
            yield s
    finally:
        engine.shutdown()


# Step costs the promise tests give the step-latency model (10 ms + 10 ms per sequence: two
# ultrafast requests decode at 31.7 tokens/s each under "auto"), whatever the machine's speed.
KNOWN_COSTS = [0.01, 0.01, 0.0, 0.0]


def known_costs_engine(root: Path, lanes: dict) -> AsyncEngine:
    """An engine on a tiny Llama with a long context, `lanes`, and `KNOWN_COSTS` kept while
    serving (targets resolved from them, never refitted)."""
    from ..conftest import make_checkpoint

    model = make_checkpoint(root, "llama", max_position_embeddings=4096)
    eng = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=1024, seed=0, lanes=lanes))
    eng.step_model.set_costs(KNOWN_COSTS)
    eng.step_model.refit_every = 10**9
    eng.targets.resolve()
    return AsyncEngine(eng, calibrate=False)
