"""Property-based fuzzing of the HTTP endpoints of a real server (raw httpx, since the SDK
cannot send most of these bodies): no answer is a 5xx, every 4xx is in OpenAI's error shape,
and a 200 stream does not fail inside.
Last, schemathesis generates cases from the server's own `/openapi.json` (`test_openapi_*`).
"""

from __future__ import annotations

import contextlib

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from .conftest import (
    BASE,
    FUZZ,
    MODEL,
    Raw,
    deep,
    error_shape_problem,
    http_problem,
    non_finite,
    plain_values,
    post,
    sampling_bodies,
)
from .conftest import bodies as body_strategy

PATHS = list(BASE)


@pytest.mark.parametrize("path", PATHS)
@FUZZ
@given(data=st.data())
def test_wrongly_shaped_bodies_get_4xx(http, path, data):
    body = data.draw(body_strategy(path, plain_values))
    problem = http_problem(path, *post(http, path, body))
    assert problem is None, problem


@pytest.mark.parametrize("path", PATHS)
@FUZZ
@given(data=st.data())
def test_out_of_range_sampling_integers_get_4xx(http, path, data):
    body = data.draw(sampling_bodies(path))
    problem = http_problem(path, *post(http, path, body))
    assert problem is None, problem


@pytest.mark.parametrize("path", PATHS)
@FUZZ
@given(data=st.data())
def test_non_finite_numbers_and_lone_surrogates_are_rejected(http, path, data):
    body = data.draw(body_strategy(path, non_finite))
    body_text, r = post(http, path, body)
    assert 400 <= r.status_code < 500, f"POST {path} {body_text[:300]!r} -> {r.status_code}"
    assert error_shape_problem(r.json()) is None, r.text[:300]


NESTED_AT = {
    "metadata": lambda levels: {"metadata": deep(levels)},
    "tool parameters": lambda levels: {
        "tools": [{"type": "function", "name": "f", "parameters": {"p": deep(levels)}}]
    },
    "objects": lambda levels: {"x": Raw('{"a":' * levels + "1" + "}" * levels)},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["metadata", "tool parameters", "objects"])
def test_nesting_5000_deep_gets_4xx(http, path, where):
    body = {**BASE[path], **NESTED_AT[where](5000)}
    problem = http_problem(path, *post(http, path, body))
    assert problem is None, problem


BAD_TEXTS = {
    "empty": b"",
    "not json": b"hello",
    "invalid utf-8": b'{"model": "\xff\xfe"}',
    "array": b"[1, 2]",
    "number": b"1e999999",
    "truncated": b'{"model": "llama", "input": "x',
    "duplicate keys": b'{"model": 1, "model": "llama", "input": "x", "max_output_tokens": 1}',
    "null": b"null",
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(BAD_TEXTS))
def test_unparseable_bodies_get_4xx(http, path, name):
    r = http.post(path, content=BAD_TEXTS[name], headers={"content-type": "application/json"})
    problem = http_problem(path, repr(BAD_TEXTS[name]), r)
    assert problem is None, problem


@pytest.mark.parametrize("path", PATHS)
def test_body_over_the_size_limit_gets_413(http, path):
    filler = "x" * (17 * 2**20)
    body = dict(BASE[path], user=filler)
    body_text, r = post(http, path, body)
    assert r.status_code == 413, r.text[:300]
    assert error_shape_problem(r.json()) is None


ID_CHARS = st.characters(exclude_categories=("Cs", "Cc"))
ids = st.one_of(
    st.text(ID_CHARS, max_size=40),
    st.just("resp_" + "0" * 32),
    st.just("x" * 5000),
    st.sampled_from(["%ED%A0%80", "%FF%FE", "..%2F..%2Fetc", "%00", "resp_%0A"]),
)
QUERY = st.dictionaries(
    st.sampled_from(["stream", "starting_after", "limit", "order", "after", "include[]"]),
    st.sampled_from(["true", "1", "-1", str(2**64), "NaN", "desc", ""])
    | st.text(ID_CHARS, max_size=8),
    max_size=3,
)
ROUTES = [
    ("GET", "/v1/responses/{}"),
    ("DELETE", "/v1/responses/{}"),
    ("POST", "/v1/responses/{}/cancel"),
    ("GET", "/v1/responses/{}/input_items"),
    ("GET", "/v1/models/{}"),
]


@FUZZ
@given(route=st.sampled_from(ROUTES), rid=ids, query=QUERY)
def test_id_routes_with_random_ids_get_4xx(http, route, rid, query):
    method, template = route
    url = httpx.URL(http.base_url.join(template.format(rid)), params=query)
    r = http.request(method, url)
    assert r.status_code < 500, f"{method} {url} -> {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert error_shape_problem(r.json()) is None, f"{method} {url}: {r.text[:300]}"


# -- schemathesis against the server's OpenAPI document ---------------------------------------

DOCUMENTED = {"400", "401", "403", "404", "413", "429"}


@pytest.fixture(scope="module")
def openapi(http) -> dict:
    return http.get("/openapi.json").json()


def test_openapi_documents_the_error_responses(openapi):
    missing = {}
    for path, methods in openapi["paths"].items():
        for method, op in methods.items():
            if path.startswith("/v1/"):
                lacking = DOCUMENTED - set(op.get("responses", {}))
                if lacking:
                    missing[f"{method.upper()} {path}"] = sorted(lacking)
    assert not missing, missing


SCHEMA_CASES = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def openapi_failures(openapi: dict, base_url: str, mode: GenerationMode) -> list[str]:
    """Requests built by schemathesis for every operation of the document that got a 5xx."""
    failures: list[str] = []
    for result in schemathesis.openapi.from_dict(openapi).get_all_operations():
        operation = result.ok()

        @SCHEMA_CASES
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            _served_and_short(case)
            response = case.call(base_url=base_url, timeout=120)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} {str(case.body)[:200]} -> "
                    f"{response.status_code} {response.text[:200]}"
                )

        with contextlib.suppress(Unsatisfiable):  # nothing to break: no parameters, no body
            run()
    return failures


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_openapi_cases_get_no_5xx(openapi, server, mode):
    """Cases schemathesis builds from /openapi.json, valid ones (positive) and ones that break
    the schema (negative), for every operation."""
    failures = openapi_failures(openapi, server.url, mode)
    assert not failures, failures[:10]


def _served_and_short(case) -> None:
    """Bodies name the served model (so valid ones reach the engine) and generate at most 8
    tokens; schemathesis picks everything else."""
    if not isinstance(case.body, dict):
        return
    if isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    for name in ("max_output_tokens", "max_tokens", "max_completion_tokens"):
        value = case.body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 8:
            case.body[name] = 8
    if "messages" in case.body and "max_tokens" not in case.body:
        case.body["max_tokens"] = 8
