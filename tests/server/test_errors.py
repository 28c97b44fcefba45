"""Error cases over raw HTTP: OpenAI's error shape, the right status, a helpful message and
`param`, and the server keeps serving everyone else."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread


def check(r: httpx.Response, status: int, param=None, code=None, says: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert says.lower() in err["message"].lower(), err["message"]
    return err


def test_malformed_json(http):
    r = http.post(
        "/v1/responses",
        content=b'{"model": "x", "input": ',
        headers={"content-type": "application/json"},
    )
    check(r, 400, code="invalid_json", says="JSON")
    r = http.post(
        "/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}
    )
    check(r, 400)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/responses", {"input": "x", "max_output_tokens": "abc"}, "max_output_tokens"),
        ("/v1/responses", {"input": "x", "temperature": "hot"}, "temperature"),
        ("/v1/responses", {"input": 5}, "input"),
        ("/v1/responses", {"input": "x", "stream": "yes"}, "stream"),
        ("/v1/responses", {"input": "x", "tools": [{"type": "teleport"}]}, "tools[0]"),
        ("/v1/responses", {"input": "x", "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/responses", {"input": [{"type": "reasoning", "content": 5}]}, "input[0].content"),
    ],
)
def test_wrong_types(http, model_name, path, body, param):
    check(http.post(path, json={"model": model_name, **body}), 400, param=param)


def test_unknown_fields_and_missing_ones(http, model_name):
    err = check(
        http.post("/v1/responses", json={"model": model_name, "input": "x", "max_tokens": 5}),
        400,
        param="max_tokens",
        code="unknown_parameter",
    )
    assert "Unrecognized request argument supplied: max_tokens" in err["message"]
    check(
        http.post("/v1/chat/completions", json={"model": model_name}),
        400,
        param="messages",
        code="missing_required_parameter",
    )
    check(
        http.post(
            "/v1/chat/completions",
            json={
                "model": model_name,
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
        ),
        400,
        param="stream_options",
    )


def test_empty_input(http, model_name):
    for inp in ("", []):
        check(
            http.post("/v1/responses", json={"model": model_name, "input": inp}),
            400,
            param="input",
            says="empty",
        )
    check(http.post("/v1/responses", json={"model": model_name}), 400, param="input")
    check(
        http.post("/v1/chat/completions", json={"model": model_name, "messages": []}),
        400,
        param="messages",
    )
    check(
        http.post("/v1/completions", json={"model": model_name, "prompt": ""}), 400, param="prompt"
    )


def test_absurd_limits_and_context_length(http, model_name):
    err = check(
        http.post(
            "/v1/responses", json={"model": model_name, "input": "x", "max_output_tokens": 10**9}
        ),
        400,
        param="max_output_tokens",
        code="context_length_exceeded",
    )
    assert "at most" in err["message"] and "max_output_tokens" in err["message"]
    check(
        http.post(
            "/v1/responses", json={"model": model_name, "input": "x", "max_output_tokens": 0}
        ),
        400,
        param="max_output_tokens",
    )
    check(
        http.post(
            "/v1/chat/completions",
            json={
                "model": model_name,
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 10**6,
            },
        ),
        400,
        param="max_completion_tokens",
        code="context_length_exceeded",
    )
    long = "lorem ipsum dolor sit amet " * 200
    check(
        http.post("/v1/responses", json={"model": model_name, "input": long}),
        400,
        param="input",
        code="context_length_exceeded",
    )
    turns = [{"role": "user", "content": "alpha beta gamma delta " * 8} for _ in range(6)]
    check(
        http.post(
            "/v1/responses", json={"model": model_name, "input": turns, "max_output_tokens": 4}
        ),
        400,
        code="context_length_exceeded",
    )
    r = http.post(
        "/v1/responses",
        json={"model": model_name, "input": turns, "max_output_tokens": 4, "truncation": "auto"},
    )
    assert r.status_code == 200 and r.json()["truncation"] == "auto"


def test_unsupported_features_say_so(http, model_name):
    check(
        http.post(
            "/v1/responses",
            json={
                "model": model_name,
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
                ],
            },
        ),
        400,
        param="input[0].content[0].type",
        says="text only",
    )
    check(
        http.post(
            "/v1/chat/completions",
            json={
                "model": model_name,
                "messages": [{"role": "user", "content": "x"}],
                "presence_penalty": 2.5,
            },
        ),
        400,
        param="presence_penalty",
        says="presence_penalty",
    )
    check(
        http.post(
            "/v1/responses",
            json={"model": model_name, "input": "x", "background": True, "store": False},
        ),
        400,
        param="background",
    )


def test_not_found_and_method(http, model_name):
    check(http.get("/v1/nothing"), 404, code="unknown_url")
    check(
        http.post("/v1/responses", json={"model": "gpt-9", "input": "x"}),
        404,
        param="model",
        code="model_not_found",
        says=model_name,
    )
    for method, path in [
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("GET", "/v1/responses/resp_nope/input_items"),
        ("POST", "/v1/responses/resp_nope/cancel"),
    ]:
        check(http.request(method, path), 404, code="response_not_found")
    check(http.get("/v1/chat/completions"), 405, code="method_not_allowed")


def test_internal_error_hides_details(tool_server, tool_engine, monkeypatch):
    def bug(*args, **kwargs):  # an unexpected exception inside the real engine (a bug)
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(tool_engine.engine.factory, "make", bug)
    r = httpx.post(
        tool_server.url + "/v1/chat/completions",
        json={"model": "llama", "messages": [{"role": "user", "content": "x"}]},
    )
    monkeypatch.undo()
    err = check(r, 500)
    assert err["type"] == "server_error" and "secret" not in r.text


def test_body_size_limit(tool_engine):
    settings = ServerSettings(store_path=":memory:", max_body_bytes=2000, served_model_name="llama")
    with ServerThread(create_app(tool_engine, settings)) as srv:
        big = {"model": "llama", "input": "x" * 5000}
        check(httpx.post(srv.url + "/v1/responses", json=big), 413, says="limit")

        def chunks():
            yield b'{"model": "llama", "input": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}'

        r = httpx.post(
            srv.url + "/v1/responses",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        check(r, 413)
        ok = httpx.post(srv.url + "/v1/responses", json={"model": "llama", "input": "hi"})
        assert ok.status_code == 200


async def test_bad_requests_do_not_disturb_other_clients(server, model_name, aclient):
    async def good():
        async with aclient.responses.stream(
            model=model_name,
            input="steady",
            temperature=0,
            max_output_tokens=16,
            extra_body={"ignore_eos": True},
        ) as stream:
            return [e async for e in stream][-1].response

    async def bad(c: httpx.AsyncClient, i: int):
        bodies = [
            b"{oops",
            b'{"model": "%s", "input": ""}' % model_name.encode(),
            b'{"model": "%s", "input": "x", "max_output_tokens": 99999999}' % model_name.encode(),
            b'{"model": "%s", "input": "x", "what": 1}' % model_name.encode(),
        ]
        r = await c.post(
            "/v1/responses", content=bodies[i % 4], headers={"content-type": "application/json"}
        )
        return r.status_code

    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        results = await asyncio.gather(good(), *(bad(c, i) for i in range(20)), good())
    assert results[0].usage.output_tokens == results[-1].usage.output_tokens == 16
    assert results[0].status == results[-1].status == "incomplete"
    assert set(results[1:-1]) == {400}
