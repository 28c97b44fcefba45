"""Errors in Anthropic's shape, for the Messages routes only: `{"type": "error", "error":
{"type", "message"}}`, the type following the status as Anthropic's does.

The server raises `APIError` everywhere (OpenAI's shape, `errors.py`); `AnthropicRoute`
converts what its routes raise, validation errors included, and `auth.py` answers a refused
key on these paths in this shape too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from expresslane.errors import ExpresslaneError
from expresslane.server.body import StrictJSONRoute
from expresslane.server.database import DatabaseUnavailable
from expresslane.server.errors import (
    PATH_SHAPES,
    APIError,
    database_unavailable,
    from_engine_error,
    internal_error,
    validation_error,
)

log = logging.getLogger("expresslane.server")
PATH = "/v1/messages"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# Set by the route: maps a response's `x-ratelimit-*` headers to Anthropic's names.
HeaderMap = Callable[[dict[str, str]], dict[str, str]]


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """The body of every error the Messages routes answer."""

    type: str = "error"
    error: AnthropicErrorDetail


# What the Messages routes answer besides success, for the OpenAPI document.
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": AnthropicErrorBody, "description": f"`{kind}`"}
    for status, kind in _TYPES.items()
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(error: APIError) -> dict:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def error_bytes(error: APIError) -> bytes:
    return json.dumps(error_body(error)).encode()


def error_response(error: APIError, headers: HeaderMap | None = None) -> JSONResponse:
    extra = headers(error.headers) if headers is not None else {}
    return JSONResponse(
        error_body(error), status_code=error.status, headers={**error.headers, **extra}
    )


PATH_SHAPES[PATH] = error_response  # what answers before the route: 413, 404, 405, 503


def as_api_error(exc: Exception) -> APIError:
    """What a Messages route raised, as the APIError the other routes would answer."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_error(list(exc.errors()))
    if isinstance(exc, ExpresslaneError):
        return from_engine_error(exc, "chat_max_tokens")
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, str(exc.detail))
    if isinstance(exc, DatabaseUnavailable):
        return database_unavailable()
    log.exception("unhandled error on a Messages route", exc_info=exc)
    return internal_error()


class AnthropicRoute(StrictJSONRoute):
    """A route whose errors are in Anthropic's shape (with the key's rate-limit headers in
    Anthropic's names, `request.state.anthropic_headers`)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def anthropic_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # every error of these routes is answered here
                names = getattr(request.state, "anthropic_headers", None)
                return error_response(as_api_error(exc), names)

        return anthropic_handler
