"""Strict JSON for request bodies and WebSocket messages.

Python's `json` accepts what no JSON peer sends and what the server cannot answer with:
`NaN`/`Infinity` (and numbers like `1e400` that overflow to infinity), strings holding lone
UTF-16 surrogates (`"\\ud800"`), and nesting deep enough to exhaust the recursion limit. Each is
refused here, before validation, with a `json.JSONDecodeError` that says what was wrong (FastAPI
turns it into a 400 `invalid_json`). HTTP bodies are parsed off the event loop (`StrictJSONRoute`),
so a large body delays only its own request.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

MAX_DEPTH = 32  # objects and arrays nested deeper than this are refused


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a 64-bit float")
    return value


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_value(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise ValueError for nesting deeper than `max_depth` or a string with a lone surrogate
    (in a key or a value). Iterative: a deep value cannot exhaust the stack here."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                raise ValueError("a string holds a lone UTF-16 surrogate, which is not text")
        elif isinstance(item, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"objects and arrays may nest at most {max_depth} levels deep")
            children = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            for key, child in children:
                if key is not None and _has_surrogate(key):
                    raise ValueError("a key holds a lone UTF-16 surrogate, which is not text")
                stack.append((child, depth + 1))


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads` that refuses non-finite numbers, lone surrogates and deep nesting; every
    refusal is a `json.JSONDecodeError`."""
    doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        check_value(value, max_depth)
    except json.JSONDecodeError:
        raise
    except RecursionError as e:
        raise json.JSONDecodeError(
            f"objects and arrays may nest at most {max_depth} levels deep", doc, 0
        ) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise json.JSONDecodeError(str(e), doc, 0) from e
    return value


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(loads, body) if len(body) > 65536 else loads(body)
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON bodies go through `loads` (large ones on a worker thread)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
