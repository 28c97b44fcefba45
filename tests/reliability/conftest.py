"""Reliability fixtures, raw JSON text and hypothesis strategies of hostile request bodies.

- `engine`, `server`: the real engine on the tiny random-weight Llama (served as "llama"),
  behind a real uvicorn server on 127.0.0.1, one pair for this folder's session.
- `Raw` and `dumps`: JSON text that `json.dumps` will not build from Python values but a
  client can send: `NaN`/`Infinity`, nesting thousands of levels deep (lone surrogates are
  written as `\\ud800` escapes by `json.dumps` itself).
- Strategies: a valid base body per POST endpoint with fields replaced, added or removed.
  `plain_values` are well-formed JSON of the wrong shape; `extreme_ints` and `non_finite`
  are the out-of-range numbers and unencodable strings that the engine must bound.
- Checks: `error_shape_problem` (OpenAI's error shape), `sse_server_errors` (a 200 stream
  that failed inside), `wait_idle` (no request running, every KV block free).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from ..server.conftest import ServerThread, metric

MODEL = "llama"
TIERS = ["ultrafast", "default", "flex", "auto", "priority", "fast", "standard"]
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
FUZZ = settings(  # the examples every fuzz test of this folder draws
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="session")
def server(engine):
    settings = ServerSettings(store_path=":memory:", served_model_name=MODEL)
    with ServerThread(create_app(engine, settings)) as s:
        yield s


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# -- raw JSON text ---------------------------------------------------------------------------


class Raw(str):
    """JSON text inserted verbatim by `dumps`."""


def deep(levels: int, open_: str = "[", close: str = "]") -> Raw:
    return Raw(open_ * levels + close * levels)


NAN, INF, NEG_INF = Raw("NaN"), Raw("Infinity"), Raw("-Infinity")


def dumps(value) -> str:
    """JSON text of `value`, with `Raw` parts inserted as they are."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


# -- request bodies --------------------------------------------------------------------------

BASE = {
    "/v1/responses": {"model": MODEL, "input": "def f(x):", "max_output_tokens": 2},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/v1/completions": {"model": MODEL, "prompt": "def f(x):", "max_tokens": 2},
}
COMMON = [
    "model", "stream", "temperature", "top_p", "top_k", "seed", "stop", "service_tier",
    "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "user",
    "stream_options", "tools", "tool_choice", "repetition_penalty", "min_p",
]  # fmt: skip
FIELDS = {
    "/v1/responses": COMMON + [
        "input", "instructions", "background", "max_output_tokens", "top_logprobs",
        "previous_response_id", "store", "metadata", "reasoning", "truncation", "text",
        "include", "parallel_tool_calls", "max_tool_calls", "prompt_cache_key",
    ],
    "/v1/chat/completions": COMMON + [
        "messages", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs",
        "response_format", "logit_bias", "metadata", "parallel_tool_calls", "presence_penalty",
        "frequency_penalty",
    ],
    "/v1/completions": COMMON + [
        "prompt", "max_tokens", "n", "logprobs", "echo", "suffix", "best_of", "logit_bias",
        "presence_penalty", "frequency_penalty",
    ],
}  # fmt: skip
# Fields that bound the generation: never removed, so no example generates to the context end.
LENGTH_FIELDS = {"max_output_tokens", "max_tokens"}
SAMPLING_INTS = ["seed", "top_k", "n", "logprobs", "top_logprobs", "min_tokens", "best_of"]

text = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-1000, 1000)
    | st.floats(-1e6, 1e6, allow_nan=False)
    | text
    | st.sampled_from(TIERS + ["turbo", "", "ULTRAFAST"])
)
plain_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
extreme_ints = st.sampled_from([2**64, 10**100, 2**63, -(2**63) - 1, 2**53 + 1, -(10**30)])
bad_strings = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800"])
non_finite = st.sampled_from([NAN, INF, NEG_INF]) | bad_strings


def tool_with(params) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.just("f"), "parameters": params}
    )


def item_with(value) -> st.SearchStrategy:
    """An input item or chat message whose content (or role) is `value`."""
    role = st.sampled_from(["user", "assistant", "system", "developer", "tool"])
    return st.one_of(
        st.fixed_dictionaries({"role": role, "content": value}),
        st.fixed_dictionaries({"role": value, "content": st.just("hi")}),
        st.fixed_dictionaries(
            {"role": role, "content": st.lists(st.fixed_dictionaries({
                "type": st.sampled_from(["input_text", "output_text", "text", "image"]),
                "text": value,
            }), min_size=1, max_size=2)}
        ),
    )  # fmt: skip


def _placed(path: str, value) -> st.SearchStrategy:
    """Strategies of (field, value) pairs that put `value` at the top level or nested."""
    nested = {
        "/v1/responses": ("input", st.lists(item_with(value), min_size=1, max_size=2)),
        "/v1/chat/completions": ("messages", st.lists(item_with(value), min_size=1, max_size=2)),
        "/v1/completions": ("prompt", st.lists(value, min_size=1, max_size=2)),
    }[path]
    return st.one_of(
        st.tuples(st.sampled_from(FIELDS[path]), value),
        st.tuples(st.just(nested[0]), nested[1]),
        st.tuples(st.just("tools"), st.lists(tool_with(value), min_size=1, max_size=1)),
        st.tuples(st.just("stop"), st.lists(value, min_size=1, max_size=3)),
    )


@st.composite
def bodies(draw, path: str, values: st.SearchStrategy = plain_values) -> dict:
    """A base body of `path` with 1-3 fields replaced by `values` (nested too), maybe an
    unknown field added or a field removed, and maybe streamed."""
    body = dict(BASE[path])
    placed = set()
    for _ in range(draw(st.integers(1, 3))):
        field, value = draw(_placed(path, values))
        if field in LENGTH_FIELDS and value is None:
            continue
        body[field] = value
        placed.add(field)
    action = draw(st.sampled_from(["none", "none", "unknown", "remove"]))
    if action == "unknown":
        body[draw(text)] = draw(plain_values)
    elif action == "remove":
        removable = sorted(set(body) - LENGTH_FIELDS - placed)  # the drawn values stay
        if removable:
            body.pop(draw(st.sampled_from(removable)))
    if draw(st.booleans()):
        body["stream"] = True
    return body


@st.composite
def sampling_bodies(draw, path: str) -> dict:
    """A valid body with sampling on and one or two integer parameters out of any range."""
    body = {**BASE[path], "temperature": 1.0}
    for field in draw(st.lists(st.sampled_from(SAMPLING_INTS), min_size=1, max_size=2)):
        body[field] = draw(extreme_ints)
    if draw(st.booleans()):
        body["stop_token_ids"] = [draw(extreme_ints)]
    return body


# -- checks ----------------------------------------------------------------------------------


def error_shape_problem(body) -> str | None:
    """None if `body` is `{"error": {"message": str, "type": str, "param", "code"}}`."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"no 'error' object in {str(body)[:200]}"
    missing = {"message", "type", "param", "code"} - set(err)
    if missing:
        return f"error lacks {sorted(missing)}: {err}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"error message is not a text: {err}"
    if not isinstance(err["type"], str):
        return f"error type is not a text: {err}"
    return None


def _is_server_error(err) -> bool:
    return isinstance(err, dict) and "server_error" in (err.get("code"), err.get("type"))


def sse_server_errors(text: str) -> list[str]:
    """The data lines of an SSE body that report a server-side failure."""
    found = []
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        data = json.loads(line[6:])
        response = data.get("response") if isinstance(data.get("response"), dict) else {}
        if (
            _is_server_error(data.get("error"))
            or _is_server_error(response.get("error"))
            or (data.get("type") == "error" and data.get("code") == "server_error")
        ):
            found.append(line[:300])
    return found


def http_problem(path: str, body_text: str, r: httpx.Response) -> str | None:
    """What is wrong with the answer `r` to a fuzzed request, or None."""
    where = f"POST {path} {body_text[:300]!r} -> {r.status_code} {r.text[:300]!r}"
    if r.status_code >= 500:
        return where
    if r.status_code >= 400:
        try:
            problem = error_shape_problem(r.json())
        except ValueError:
            problem = "the body is not JSON"
        return f"{problem}: {where}" if problem else None
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        errors = sse_server_errors(r.text)
        return f"stream failed inside: {errors[:2]}: {where}" if errors else None
    return None


def post(http: httpx.Client, path: str, body) -> tuple[str, httpx.Response]:
    body_text = body if isinstance(body, str) else dumps(body)
    import time as _t

    _s = _t.time()
    try:
        r = http.post(path, content=body_text, headers={"content-type": "application/json"})
    finally:
        if _t.time() - _s > 3:
            print("SLOW", round(_t.time() - _s, 1), path, body_text[:400], flush=True)
    return body_text, r


def wait_idle(server_url: str, engine, timeout: float = 60) -> None:
    """Wait (bounded) until the engine runs and queues nothing and every KV block is free."""
    kv = engine.engine.kv
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server_url + "/metrics", timeout=30).text
        busy = (
            metric(text, "expresslane:num_requests_running"),
            metric(text, "expresslane:num_requests_waiting"),
            kv.num_used_blocks,
        )
        if busy == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"still busy: running, waiting, used blocks = {busy}"
        time.sleep(0.1)
