"""Property-based fuzzing of Responses WebSocket mode on a real server: every bad message is
answered by an `{"type": "error", "status": 4xx, "error": {...}}` event, and the socket stays
open: a valid message sent after it on the same socket (or queued behind it) is answered."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.sync.client import connect

from .conftest import (
    FUZZ,
    MODEL,
    TERMINAL,
    Raw,
    bodies,
    deep,
    dumps,
    error_shape_problem,
    non_finite,
    plain_values,
    sampling_bodies,
)

VALID = json.dumps(
    {"type": "response.create", "model": MODEL, "input": "hi", "max_output_tokens": 2}
)


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def answer(ws) -> dict:
    """The event that ends the answer to one message: an error or a terminal event."""
    while True:
        event = json.loads(ws.recv(timeout=120))
        if event["type"] == "error" or event["type"] in TERMINAL:
            return event


def assert_client_error(event: dict, message: str) -> None:
    where = f"{message[:300]!r} -> {json.dumps(event)[:300]}"
    if event["type"] == "error":
        status = event.get("status")
        assert isinstance(status, int) and 400 <= status < 500, where
        assert error_shape_problem(event) is None, where
    else:  # accepted: then it must not have failed on the server's side
        error = event["response"].get("error") or {}
        assert error.get("code") != "server_error", where


def send_then_valid(server, message: str | bytes, queued: bool = False) -> dict:
    """Send `message`, then a valid one on the same socket (`queued`: before any answer);
    return the answer to the first and assert the valid one completed."""
    with connect(ws_url(server), max_size=None, open_timeout=30) as ws:
        ws.send(message)
        if queued:
            ws.send(VALID)
        first = answer(ws)
        if not queued:
            ws.send(VALID)
        follow = answer(ws)
    assert follow["type"] in ("response.completed", "response.incomplete"), follow
    return first


def ws_message(body: dict, draw) -> str:
    body = {"type": "response.create", **body}
    if draw(st.booleans()):
        body["stream_id"] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        body["generate"] = draw(st.sampled_from([False, True, None, "no"]))
    return dumps(body)


@FUZZ
@given(data=st.data())
def test_wrongly_shaped_messages_get_an_error_event_and_the_socket_stays_open(server, data):
    message = ws_message(data.draw(bodies("/v1/responses", plain_values)), data.draw)
    assert_client_error(send_then_valid(server, message), message)


not_a_create = st.one_of(
    plain_values.map(json.dumps),
    st.text(max_size=40),
    st.fixed_dictionaries({"type": plain_values}).map(json.dumps),
    st.sampled_from(['{"type": "response.cancel"}', "", "{", "null", '{"type": null}']),
)


@FUZZ
@given(message=not_a_create)
def test_messages_that_are_not_a_create_get_an_error_event(server, message):
    first = send_then_valid(server, message)
    assert first["type"] == "error", first
    assert_client_error(first, message)


@pytest.mark.parametrize("payload", [b"\xff\xfe\x00", VALID.encode()], ids=["garbage", "valid"])
def test_binary_frames_are_answered(server, payload):
    first = send_then_valid(server, payload)
    assert_client_error(first, repr(payload))


@pytest.mark.parametrize("nest", ["arrays", "objects"])
def test_deep_nesting_gets_an_error_event_and_the_queued_message_is_answered(server, nest):
    value = deep(5000) if nest == "arrays" else Raw('{"a":' * 5000 + "1" + "}" * 5000)
    message = dumps({"type": "response.create", "model": MODEL, "input": "x", "metadata": value})
    first = send_then_valid(server, message, queued=True)
    assert first["type"] == "error", first
    assert_client_error(first, message)


@FUZZ
@given(data=st.data())
def test_out_of_range_sampling_integers_get_an_error_event(server, data):
    body = data.draw(sampling_bodies("/v1/responses"))
    message = ws_message(body, data.draw)
    assert_client_error(send_then_valid(server, message), message)


@FUZZ
@given(data=st.data())
def test_non_finite_numbers_and_lone_surrogates_get_an_error_event(server, data):
    message = ws_message(data.draw(bodies("/v1/responses", non_finite)), data.draw)
    first = send_then_valid(server, message)
    assert first["type"] == "error", f"{message[:300]!r} -> {json.dumps(first)[:300]}"
    assert_client_error(first, message)
