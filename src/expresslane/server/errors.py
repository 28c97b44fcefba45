"""Every error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Validation errors (pydantic), unknown paths (404), wrong methods (405), oversized bodies (413)
and unexpected exceptions (500, logged, never a traceback in the body) all go through here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from expresslane.errors import ExpresslaneError
from expresslane.server.database import DatabaseUnavailable

log = logging.getLogger("expresslane.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def _documented(status: int, description: str) -> dict:
    return {"model": ErrorBody, "description": description}


# What the API routes answer besides success, for the OpenAPI document.
ERROR_RESPONSES: dict[int | str, dict] = {
    400: _documented(400, "Invalid request: the message and `param` name what to fix."),
    401: _documented(401, "Missing, unknown or revoked API key."),
    403: _documented(403, "The API key may not use the asked tier."),
    404: _documented(404, "Unknown model or response id (or another key's response)."),
    413: _documented(413, "The request body is over the server's size limit."),
    429: _documented(
        429, "Rate limit, quota or queue full; `Retry-After` and `x-ratelimit-*` headers."
    ),
    503: _documented(503, "The server is starting or shutting down; retry elsewhere or later."),
}


class APIError(Exception):
    """An error the API reports to the client as is."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = dict(headers or {})  # its own copy: shared tables stay as they are
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Paths whose errors are answered in another API's shape: prefix -> the response of an error
# (`anthropic_errors.py` adds /v1/messages), for what answers before a route runs.
PATH_SHAPES: dict[str, Callable[[APIError], Response]] = {}


def response_for(path: str, error: APIError) -> Response:
    """`error` as the API at `path` writes errors."""
    for prefix, shape in PATH_SHAPES.items():
        if path.startswith(prefix):
            return shape(error)
    return error.response()


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


# Each API's names for the engine's request fields (SamplingParams' and the prompt), where
# they differ: an engine error names the field as data (`ExpresslaneError.fields`), and the
# client reads its own API's name, in `param` and in the message. One table for every API.
API_FIELDS: dict[str, dict[str, str]] = {
    "chat": {
        "max_tokens": "max_completion_tokens",
        "prompt": "messages",
        "logprobs": "top_logprobs",
    },
    # Chat with its deprecated max_tokens: errors name the field the client sent
    "chat_max_tokens": {"prompt": "messages", "logprobs": "top_logprobs"},
    "completions": {},  # the engine's names are the Completions API's
    "responses": {"max_tokens": "max_output_tokens", "prompt": "input", "logprobs": "top_logprobs"},
}


def from_engine_error(e: ExpresslaneError, api: str | None = None) -> APIError:
    """Map an engine error, naming its fields (max_tokens, prompt) by the API's own names
    (max_output_tokens, input for the Responses API)."""
    names = API_FIELDS[api] if api is not None else {}
    param = names.get(e.param, e.param) if e.param else None
    return APIError(e.status, e.text(names), param=param, code=e.code, type=e.type)


# A 429 for a server too busy to take the request: come back in a second.
BUSY_HEADERS = {
    "retry-after": "1",
    "retry-after-ms": "1000",
    "x-ratelimit-remaining-requests": "0",
    "x-ratelimit-reset-requests": "1s",
}


def generation_error(message: str | None) -> APIError:
    """The answer for a generation that ended with an engine error: 429 for a request the
    overloaded engine never started (`queue_timeout`), else 500."""
    if message and message.startswith("queue_timeout"):
        return APIError(
            429,
            "The server is overloaded: this request waited in its lane's queue without "
            "starting; retry after the Retry-After delay.",
            code="queue_timeout",
            headers=BUSY_HEADERS,
        )
    return APIError(
        500, message or "the generation ended early", code="server_error", type="server_error"
    )


def database_unavailable() -> APIError:
    """The shared database cannot be reached: the request did nothing; retrying is safe."""
    return APIError(
        503,
        "The server's database is unavailable; nothing was done. Retry shortly.",
        code="database_unavailable",
        type="server_error",
        headers={"Retry-After": "1"},
    )


def internal_error() -> APIError:
    return APIError(
        500,
        "The server had an error while processing your request; it has been "
        "logged. Retry, and report it if it persists.",
        code="server_error",
        type="server_error",
    )


def _param_from_loc(loc: tuple) -> str | None:
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" in item or item[:1].isupper() or item in ("str", "int", "float", "bool", "none"):
            continue  # a pydantic union-member tag, not a field
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def validation_error(errors: list[dict]) -> APIError:
    def field(err: dict) -> tuple:
        loc = tuple(err.get("loc", ()))
        return loc[1:2] if loc[:1] == ("body",) else loc[:1]

    # Of the errors for the first bad field, the deepest says most (union members each
    # report one; the one that got furthest is usually the one the client meant).
    same = [e for e in errors if field(e) == field(errors[0])]
    e = max(same, key=lambda e: len(e.get("loc", ())))
    kind, param = e.get("type", ""), _param_from_loc(tuple(e.get("loc", ())))
    if kind == "json_invalid":
        return invalid(
            "We could not parse the JSON body of your request: "
            f"{e.get('ctx', {}).get('error', 'invalid JSON')}. Send a JSON object "
            "with Content-Type: application/json.",
            code="invalid_json",
        )
    if kind == "extra_forbidden":
        return invalid(
            f"Unrecognized request argument supplied: {param}. Remove it; see "
            "GET /docs for the fields this endpoint accepts.",
            param=param,
            code="unknown_parameter",
        )
    if kind == "missing":
        if param is None:
            return invalid("The request body is missing: send a JSON object.", code="missing_body")
        return invalid(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if param is None:
        return invalid("The request body must be a JSON object.", code="invalid_type")
    got = repr(e.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return invalid(
        f"Invalid value for '{param}': {e.get('msg', 'invalid')} (got {got}).",
        param=param,
        code=code,
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(ExpresslaneError)
    async def _engine_error(request: Request, exc: ExpresslaneError):
        return from_engine_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = not_found(
                f"Unknown path {request.method} {request.url.path}; see GET /docs "
                "for the endpoints this server offers.",
                code="unknown_url",
            )
        elif exc.status_code == 405:
            err = APIError(
                405,
                f"Method {request.method} is not allowed on {request.url.path}.",
                code="method_not_allowed",
            )
        elif exc.status_code == 413:
            err = APIError(413, str(exc.detail), code="request_too_large")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return response_for(request.url.path, err)

    @app.exception_handler(DatabaseUnavailable)
    async def _database(request: Request, exc: DatabaseUnavailable):
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        return database_unavailable().response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(
            413,
            f"The request body is larger than this server's limit of "
            f"{limit} bytes; send a smaller request.",
        )


class BodySizeLimit:
    """ASGI middleware: 413 for HTTP bodies over `limit` bytes (by Content-Length, or counted
    while the body is read)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                err = APIError(413, BodyTooLarge(self.limit).detail, code="request_too_large")
                return await response_for(scope["path"], err)(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)
