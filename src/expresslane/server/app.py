"""The FastAPI app (`create_app`) and `expresslane serve` (`serve`).

Routes: /v1/responses (+ WebSocket mode), /v1/chat/completions, /v1/completions, /v1/models,
/health (alive), /ready (taking work: 503 while starting or draining), /metrics. The server
talks to the engine only through `AsyncEngine`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from expresslane.lanes import build_lanes
from expresslane.server import chat, completions, responses, websocket
from expresslane.server.accounts import Accounts, QueueLimits
from expresslane.server.auth import AuthMiddleware
from expresslane.server.durability import recover
from expresslane.server.errors import ERROR_RESPONSES, BodySizeLimit, install_error_handlers
from expresslane.server.lifecycle import (
    DrainGate,
    DrainingServer,
    Lifecycle,
    interrupt_all,
    readiness,
)
from expresslane.server.metering import Prices
from expresslane.server.metrics import ServerMetrics
from expresslane.server.settings import ServerSettings, engine_options_from_toml
from expresslane.server.state import ServerState, get_state
from expresslane.server.store import ResponseStore
from expresslane.tool_parsers import detect_tool_parser, get_tool_parser

log = logging.getLogger("expresslane.server")
DEMO_MODEL_NAME = "expresslane-demo"
# a served request not started within this many seconds answers 429 queue_timeout (the
# offline LLM waits as long as it takes)
SERVE_MAX_QUEUE_SECONDS = 60.0
UVICORN_GRACE_S = 2.0


def _model_names(async_engine) -> tuple[str, set[str]]:
    config = getattr(getattr(async_engine, "engine", None), "config", None)
    model = getattr(config, "model", None)
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


def create_app(async_engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    name, aliases = _model_names(async_engine)
    name = settings.served_model_name or name
    tokenizer = getattr(async_engine, "tokenizer", None)
    if settings.tool_parser == "auto":
        parser = detect_tool_parser(getattr(tokenizer, "chat_template_source", None))
    else:
        parser = get_tool_parser(settings.tool_parser)
    if tokenizer is not None and _markers_are_special(tokenizer, parser.start_markers):
        parser.needs_special_tokens = True  # keep them in the text so calls can be parsed
    lanes = getattr(getattr(async_engine, "engine", None), "lanes", None) or build_lanes(None)
    accounts = Accounts(
        settings.resolved_accounts_path(),
        Prices.from_table(settings.prices),
        lanes,
        QueueLimits(settings.max_queued_per_lane, settings.max_in_flight_per_key),
    )
    state = ServerState(
        engine=async_engine,
        accounts=accounts,
        settings=settings,
        store=ResponseStore(settings.resolved_store_path()),
        metrics=ServerMetrics(async_engine, name),
        model_name=name,
        tool_parser=parser,
        model_aliases=aliases,
    )

    lifecycle = Lifecycle(lambda: accounts.saturated(async_engine.lane_load))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        recover(state.store, accounts)  # what a killed server left running
        yield
        await interrupt_all(state)  # whatever outlived the graceful period: kept, billed
        state.store.close()
        accounts.close()

    app = FastAPI(title="expresslane", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.state.lifecycle = lifecycle
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, accounts=accounts)
    app.add_middleware(DrainGate, lifecycle=lifecycle)
    for module in (responses, websocket, chat, completions):
        app.include_router(module.router, responses=ERROR_RESPONSES)

    def model_card(state: ServerState) -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "expresslane",
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def list_models(request: Request):
        return {"object": "list", "data": [model_card(get_state(request))]}

    @app.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def retrieve_model(model_id: str, request: Request):
        state = get_state(request)
        state.check_model(model_id)
        return model_card(state)

    @app.get("/health")
    async def health(request: Request):
        engine = get_state(request).engine
        if hasattr(engine, "is_alive") and not engine.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        why = readiness(get_state(request), request.app.state.lifecycle)
        if why is not None:
            return JSONResponse({"status": why}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics(request: Request):
        body = get_state(request).metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document without its 422 answers: validation errors are 400 here."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for methods in doc["paths"].values():
            for op in methods.values():
                op.get("responses", {}).pop("422", None)
        app.openapi_schema = doc
    return app.openapi_schema


def _merged_engine_options(args, cli_options: dict) -> dict:
    """Config-file [engine] values, overridden by flags that differ from their defaults."""
    from expresslane.cli import _engine_options, build_parser

    defaults = _engine_options(build_parser().parse_args(["serve"]))
    options = engine_options_from_toml(getattr(args, "config", None))
    for key, value in cli_options.items():
        if key == "lanes":  # per setting: flags over the file
            for lane, settings in value.items():
                options.setdefault("lanes", {}).setdefault(lane, {}).update(settings)
        elif key not in options or value != defaults.get(key):
            options[key] = value
    return options


def serve(args, engine_options: dict) -> int:
    """`expresslane serve`: load the model, then serve until SIGINT/SIGTERM; then the server
    drains (`lifecycle.py`): new work gets 503, in-flight requests get
    `graceful_shutdown_seconds` to finish, and responses still running then end incomplete,
    stored and billed."""
    import uvicorn

    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine
    from expresslane.errors import ExpresslaneError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    defaults = ServerSettings()
    try:
        settings = ServerSettings.from_toml(
            getattr(args, "config", None),
            host=args.host if args.host != defaults.host else None,
            port=args.port if args.port != defaults.port else None,
            accounts_path=getattr(args, "accounts", None),
        )
        options = _merged_engine_options(args, engine_options)
    except (OSError, ValueError) as e:
        print(f"expresslane serve: bad config: {e}", file=sys.stderr)
        return 2
    model = args.model or options.pop("model", None)
    options.pop("model", None)
    options.setdefault("max_queue_seconds", SERVE_MAX_QUEUE_SECONDS)
    try:
        engine = AsyncEngine(LLMEngine(EngineConfig.from_options(model, options)))
    except (ExpresslaneError, OSError, ValueError, KeyError) as e:
        print(f"expresslane serve: cannot load the model: {e}", file=sys.stderr)
        return 2
    # Calibrate the step-latency model on a quiet machine, before the server starts.
    while not engine.ready.wait(1.0):
        if not engine.is_alive():
            print("expresslane serve: the engine stopped while starting", file=sys.stderr)
            return 2
    # The engine thread holds the GIL between tensor ops; by default a waiting thread gets it
    # only after 5 ms, which would delay every streamed token by up to that much.
    sys.setswitchinterval(0.0005)
    app = create_app(engine, settings)
    log.info(
        "serving %s on http://%s:%d/v1", app.state.server.model_name, settings.host, settings.port
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=UVICORN_GRACE_S,  # after the drain: what is left is closing
    )
    try:
        DrainingServer(config, app.state.server, app.state.lifecycle).run()
    finally:
        engine.shutdown()
    return 0
