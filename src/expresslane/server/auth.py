"""ASGI middleware: authenticate every /v1 request (HTTP and WebSocket) and put the request's
rate-limit headers on its response, streamed or not.

The authenticated key is left in the request's state (`request.state.api_key`); the route sets
`request.state.ticket` once it has admitted the request, and the ticket's `x-ratelimit-*`
headers and the tier that serves it (`x-expresslane-served-tier`, a downgraded request's
included) are added when the response starts.

Anthropic's `x-api-key: KEY` header works as `Authorization: Bearer KEY` (which wins when both
are sent); on Anthropic's paths (/v1/messages) a refused key is answered in Anthropic's error
shape. An Authorization header that is not printable ASCII is refused with 401 before any lookup
(no key has such characters). `operator_key` authenticates the routes outside /v1 that only
the operator may see (`/fleet/status`, per-key `/metrics`).
"""

from __future__ import annotations

import json
import logging

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from expresslane.server import anthropic_errors
from expresslane.server.database import DatabaseUnavailable
from expresslane.server.errors import APIError, database_unavailable
from expresslane.server.keys import OPEN_ACCESS_ID, ApiKey

log = logging.getLogger("expresslane.server")
SERVED_TIER = "x-expresslane-served-tier"


class AuthMiddleware:
    def __init__(self, app: ASGIApp, accounts):
        self.app = app
        self.accounts = accounts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        state = scope.setdefault("state", {})
        try:
            state["api_key"] = authenticate(self.accounts, credential(headers))
        except APIError as e:
            await _deny(scope, send, e)
            return
        except DatabaseUnavailable as e:
            log.warning("%s: %s", scope["path"], e)
            await _deny(scope, send, database_unavailable())
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                ticket = state.get("ticket")
                if ticket is not None:
                    present = {k.lower() for k, _ in message.get("headers", [])}
                    served = {SERVED_TIER: ticket.lane}
                    extra = [
                        (k.encode(), v.encode())
                        for k, v in {**ticket.headers, **served}.items()
                        if k.encode() not in present
                    ]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def credential(headers: dict[str, str]) -> str | None:
    """The Authorization header, or Anthropic's `x-api-key` as its Bearer form."""
    authorization = headers.get("authorization")
    if authorization is None and headers.get("x-api-key"):
        return "Bearer " + headers["x-api-key"]
    return authorization


def authenticate(accounts, authorization: str | None) -> ApiKey:
    """The key the Authorization header names (raises APIError 401 as `Accounts` does)."""
    if authorization is not None and not (authorization.isascii() and authorization.isprintable()):
        raise APIError(
            401,
            "Incorrect API key provided: the Authorization header must be printable ASCII "
            "('Authorization: Bearer <key>').",
            code="invalid_api_key",
        )
    return accounts.authenticate(authorization)


def operator_key(request: Request, accounts) -> ApiKey | None:
    """The request's key if it is an operator's (open local mode counts: everyone is), else
    None; a wrong key is None too."""
    try:
        key = authenticate(accounts, request.headers.get("authorization"))
    except APIError:
        return None
    return key if key.operator or key.id == OPEN_ACCESS_ID else None


def require_operator(request: Request, accounts) -> ApiKey:
    """`operator_key`, or a 401/403 APIError in the OpenAI error shape."""
    key = operator_key(request, accounts)
    if key is not None:
        return key
    authenticate(accounts, request.headers.get("authorization"))  # a bad key: its 401
    raise APIError(
        403,
        "This route is for the server's operator: use the --api-key key or an operator key.",
        code="operator_key_required",
    )


async def _deny(scope: Scope, send: Send, error: APIError) -> None:
    if scope["path"].startswith(anthropic_errors.PATH):
        body = anthropic_errors.error_bytes(error)
    else:
        body = json.dumps(error.body()).encode()
    start = {
        "status": error.status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            *((k.lower().encode(), v.encode()) for k, v in error.headers.items()),
        ],
    }
    if scope["type"] == "http":
        await send({"type": "http.response.start", **start})
        await send({"type": "http.response.body", "body": body})
    elif "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", **start})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
