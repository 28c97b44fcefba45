"""What an operator and a browser see around the API: one log line per request with its fields,
`x-request-id` on every answer, `--api-key`, CORS when asked for, /docs and / without a CDN."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest

from expresslane.server.app import create_app
from expresslane.server.request_log import JsonFormatter, format_text
from expresslane.server.settings import ServerSettings

from .conftest import STOP_AT_FIRST, ServerThread

ORIGIN = "http://page.example"


@pytest.fixture(scope="module")
def keyed_server(engine):
    settings = ServerSettings(store_path=":memory:", api_key="sekret", allowed_origins=[ORIGIN])
    with ServerThread(create_app(engine, settings)) as s:
        yield s


def _line(caplog, request_id: str, timeout: float = 10.0) -> logging.LogRecord:
    """The access record of one request (written when its answer has been sent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in caplog.records:
            if r.name == "expresslane.access" and r.fields["request_id"] == request_id:
                return r
        time.sleep(0.02)
    raise AssertionError(f"no log line for {request_id}")


def test_request_ids_are_echoed_or_made(http):
    made = http.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert http.get("/v1/models").headers["x-request-id"] != made
    sent = http.get("/v1/models", headers={"x-request-id": "client-42"})
    assert sent.headers["x-request-id"] == "client-42"
    too_long = http.get("/v1/models", headers={"x-request-id": "x" * 500})
    assert re.fullmatch(r"[0-9a-f]{32}", too_long.headers["x-request-id"])
    bad = http.post("/v1/responses", content=b"{", headers={"x-request-id": "bad-body"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-body"


def test_one_line_per_request_with_its_fields(http, caplog, model_name):
    caplog.set_level(logging.INFO, logger="expresslane.access")
    body = {"model": model_name, "input": "def f(", "max_output_tokens": 5, "ignore_eos": True}
    r = http.post("/v1/responses", json={**body, "service_tier": "flex"})
    assert r.status_code == 200
    record = _line(caplog, r.headers["x-request-id"])
    f = record.fields
    assert record.levelno == logging.INFO
    assert (f["method"], f["path"], f["status"]) == ("POST", "/v1/responses", 200)
    assert (f["key"], f["tier_requested"], f["tier"]) == ("local", "flex", "flex")
    assert f["input_tokens"] > 0 and f["output_tokens"] == 5 and f["cached_tokens"] >= 0
    assert f["duration_s"] > 0 and f["e2e_s"] > 0 and f["ttft_s"] > 0 and f["queue_s"] >= 0
    assert f["decode_tokens_per_s"] > 0
    text = record.getMessage()
    assert text.startswith("POST /v1/responses 200 ") and "tier=flex" in text
    assert f"tokens={f['input_tokens']}/{f['cached_tokens']}/5" in text
    assert [r for r in caplog.records if r.name == "expresslane.access"].count(record) == 1


def test_streamed_request_logs_its_tokens(http, caplog, model_name):
    caplog.set_level(logging.INFO, logger="expresslane.access")
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body |= {"max_tokens": 4, "ignore_eos": True, "service_tier": "auto"}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        "".join(r.iter_text())
    f = _line(caplog, rid).fields
    assert f["output_tokens"] == 4 and f["tier_requested"] == "default"


def test_probes_log_at_debug(http, caplog):
    caplog.set_level(logging.DEBUG, logger="expresslane.access")
    rid = http.get("/health").headers["x-request-id"]
    assert _line(caplog, rid).levelno == logging.DEBUG


def test_json_format_is_one_object_per_line(http, caplog, model_name):
    caplog.set_level(logging.INFO, logger="expresslane.access")
    body = {"model": model_name, "prompt": "x", "max_tokens": 1, **STOP_AT_FIRST}
    rid = http.post("/v1/completions", json=body).headers["x-request-id"]
    line = JsonFormatter().format(_line(caplog, rid))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["logger"] == "expresslane.access" and doc["level"] == "info"
    assert doc["request_id"] == rid and doc["path"] == "/v1/completions"
    assert doc["output_tokens"] == 1 and doc["message"].startswith("POST /v1/completions 200")


def test_text_line_of_a_downgrade():
    fields = {"method": "POST", "path": "/v1/responses", "status": 200, "duration_s": 0.5}
    fields |= {"request_id": "r1", "key": "alice", "tier_requested": "ultrafast"}
    fields |= {"tier": "default", "input_tokens": 10, "cached_tokens": 4, "output_tokens": 3}
    fields |= {"ttft_s": 0.05, "decode_tokens_per_s": 42.0}
    assert format_text(fields) == (
        "POST /v1/responses 200 0.500s id=r1 key=alice tier=ultrafast->default "
        "tokens=10/4/3 ttft=0.050s decode=42.0tok/s"
    )


def test_api_key_flag(keyed_server, caplog, model_name):
    caplog.set_level(logging.INFO, logger="expresslane.access")
    url = keyed_server.url + "/v1/models"
    denied = httpx.get(url)
    assert denied.status_code == 401 and denied.headers["x-request-id"]
    assert _line(caplog, denied.headers["x-request-id"]).fields["status"] == 401
    assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(url, headers={"authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert _line(caplog, ok.headers["x-request-id"]).fields["key"] == "api-key"


def test_cors_when_origins_are_allowed(keyed_server):
    preflight = {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    r = httpx.options(keyed_server.url + "/v1/responses", headers=preflight)
    assert r.status_code == 200  # answered before auth: a preflight carries no key
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    got = httpx.get(keyed_server.url + "/v1/models", headers={"origin": ORIGIN})
    assert got.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in got.headers["access-control-expose-headers"]
    other = httpx.options(
        keyed_server.url + "/v1/responses", headers={**preflight, "origin": "http://evil.test"}
    )
    assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default(http):
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST"}
    r = http.options("/v1/responses", headers=preflight)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_their_scripts_from_this_server(http, page):
    html = http.get(page).text
    scripts = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert scripts and all(s.startswith("/") for s in scripts), scripts
    assert "https://" not in html.replace("https://fastapi.tiangolo.com", "")
    for path in scripts:
        assert http.get(path).status_code == 200, path


def test_playground_is_served_at_the_root(http, model_name):
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "https://" not in page.text and "http://" not in page.text
    for path in re.findall(r'(?:src|href)="(/playground/[^"]+)"', page.text):
        assert http.get(path).status_code == 200, path
    info = http.get("/playground/info").json()
    assert info["model"] == model_name
    assert [t["name"] for t in info["tiers"]] == ["ultrafast", "default", "flex"]
    assert info["prices"]["output_per_1m"] > 0
