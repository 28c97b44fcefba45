"""The FastAPI app (`create_app`); `expresslane serve` is `cli/serving.py`.

Routes: /v1/responses (+ WebSocket mode), /v1/chat/completions, /v1/completions, /v1/messages
(Anthropic's Messages API, `messages.py`), /v1/models,
/v1/tiers (each tier's price and promise), /health (alive), /ready (taking work: 503 while
starting or draining), /metrics, the playground at / (`pages.py`) and /docs, /redoc (their
scripts served from here, not a CDN).
The server talks to the engine only through `AsyncEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline

from expresslane.engine.protocol import ServingEngine
from expresslane.server import (
    chat,
    completions,
    messages,
    responses,
    tiers,
    tokenize,
    websocket,
)
from expresslane.server.accounts import Accounts
from expresslane.server.anthropic_errors import ANTHROPIC_ERROR_RESPONSES
from expresslane.server.auth import AuthMiddleware, operator_key
from expresslane.server.durability import recover, sweep
from expresslane.server.errors import ERROR_RESPONSES, BodySizeLimit, install_error_handlers
from expresslane.server.in_flight import QueueLimits
from expresslane.server.lifecycle import DrainGate, Lifecycle, interrupt_all, readiness
from expresslane.server.metering import Prices
from expresslane.server.metrics import ServerMetrics
from expresslane.server.pages import cors_options, install_pages
from expresslane.server.reasoning import ReasoningParser
from expresslane.server.reasoning_parsers import detect_reasoning_parser, get_reasoning_parser
from expresslane.server.request_log import RequestLog
from expresslane.server.sealing import Sealer
from expresslane.server.settings import ServerSettings
from expresslane.server.state import ServerState, get_state
from expresslane.server.store import ResponseStore
from expresslane.server.tool_parsers import detect_tool_parser, get_tool_parser

log = logging.getLogger("expresslane.server")
DEMO_MODEL_NAME = "expresslane-demo"


def _model_names(engine: ServingEngine) -> tuple[str, set[str]]:
    model = engine.model_path
    if not model:
        return DEMO_MODEL_NAME, set()
    return Path(model).name, {str(model)}


def _markers_are_special(tokenizer, markers) -> bool:
    """True if a marker is a special token that skip_special_tokens would drop."""
    for marker in markers:
        token_id = tokenizer.token_to_id(marker)
        if token_id is not None and tokenizer.decode([token_id], skip_special_tokens=True) == "":
            return True
    return False


def create_app(async_engine: ServingEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    state = _server_state(async_engine, settings)
    accounts = state.accounts
    lifecycle = Lifecycle(lambda: accounts.saturated(async_engine.lane_load))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        recover(state.store, accounts)  # what a killed server left running
        sweeper = asyncio.get_running_loop().create_task(sweep(state.store, accounts))
        yield
        sweeper.cancel()
        await interrupt_all(state)  # whatever outlived the graceful period: kept, billed
        state.store.close()
        accounts.close()

    app = FastAPIOffline(title="expresslane", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.state.lifecycle = lifecycle
    install_error_handlers(app)
    _add_middleware(app, settings, accounts, lifecycle)
    for module in (responses, websocket, chat, completions, tokenize, tiers):
        app.include_router(module.router, responses=ERROR_RESPONSES)
    app.include_router(messages.router, responses=ANTHROPIC_ERROR_RESPONSES)
    app.include_router(_models, responses=ERROR_RESPONSES)
    app.include_router(_operations)
    install_pages(app)
    app.openapi = lambda: _openapi(app)
    return app


def _server_state(engine: ServingEngine, settings: ServerSettings) -> ServerState:
    name, aliases = _model_names(engine)
    name = settings.served_model_name or name
    accounts = Accounts(
        settings.resolved_accounts_path(),
        Prices.from_table(settings.prices),
        engine.lanes,
        QueueLimits(settings.max_queued_per_lane, settings.max_in_flight_per_key),
        api_key=settings.api_key,
    )
    return ServerState(
        engine=engine,
        accounts=accounts,
        settings=settings,
        store=ResponseStore(settings.resolved_store_path()),
        metrics=ServerMetrics(engine, name),
        model_name=name,
        tool_parser=_tool_parser(settings, engine.tokenizer),
        model_aliases=aliases,
        reasoning_parser=_reasoning_parser(settings, engine.tokenizer),
        sealer=Sealer.of_database(accounts.keys.db),
    )


def _reasoning_parser(settings: ServerSettings, tokenizer) -> ReasoningParser:
    if settings.reasoning_parser == "auto":
        template = getattr(tokenizer, "chat_template_source", None)
        return detect_reasoning_parser(template, tokenizer)
    return get_reasoning_parser(settings.reasoning_parser)


def _tool_parser(settings: ServerSettings, tokenizer):
    if settings.tool_parser == "auto":
        parser = detect_tool_parser(getattr(tokenizer, "chat_template_source", None))
    else:
        parser = get_tool_parser(settings.tool_parser)
    if tokenizer is not None and _markers_are_special(tokenizer, parser.start_markers):
        parser.needs_special_tokens = True  # keep them in the text so calls can be parsed
    return parser


def _add_middleware(app: FastAPI, settings: ServerSettings, accounts, lifecycle) -> None:
    """Innermost first: the body limit, auth, the drain gate, CORS, the request log."""
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, accounts=accounts)
    app.add_middleware(DrainGate, lifecycle=lifecycle)
    if settings.allowed_origins:  # CORS: outside auth, so preflights need no key
        app.add_middleware(CORSMiddleware, **cors_options(settings.allowed_origins))
    app.add_middleware(RequestLog)  # outermost: an id and a log line for every answer


_models = APIRouter()
_operations = APIRouter()  # liveness, readiness, metrics: no key needed


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "expresslane",
        "max_model_len": state.max_model_len,
    }


@_models.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(get_state(request))]}


@_models.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request):
    state = get_state(request)
    state.check_model(model_id)
    return _model_card(state)


@_operations.get("/health")
async def health(request: Request):
    engine = get_state(request).engine
    if not engine.is_alive():
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return {"status": "ok"}


@_operations.get("/ready")
async def ready(request: Request):
    why = readiness(get_state(request), request.app.state.lifecycle)
    if why is not None:
        return JSONResponse({"status": why}, status_code=503)
    return {"status": "ready"}


@_operations.get("/metrics")
async def metrics(request: Request):
    state = get_state(request)
    per_key = state.settings.metrics_per_key or operator_key(request, state.accounts) is not None
    body = state.metrics.render(per_key)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document without its 422 answers: validation errors are 400 here."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for methods in doc["paths"].values():
            for op in methods.values():
                op.get("responses", {}).pop("422", None)
        app.openapi_schema = doc
    return app.openapi_schema
