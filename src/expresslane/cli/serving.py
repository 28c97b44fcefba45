"""`expresslane serve`: settings from the config file and the flags, checked (with the listening
socket bound) before the model loads; then the engine, then uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import sys

from expresslane.cli.arg_types import LOG_LEVELS, fail, model_dir_problem
from expresslane.server.preflight import bind, check_types, device_problem
from expresslane.server.request_log import configure_logging
from expresslane.server.settings import ServerSettings, engine_options_from_toml

log = logging.getLogger("expresslane.server")
PROG = "expresslane serve"
# a served request not started within this many seconds answers 429 queue_timeout (the
# offline LLM waits as long as it takes)
SERVE_MAX_QUEUE_SECONDS = 60.0
# requests the served engine lets wait, whatever the server's own queue bounds admit
SERVE_MAX_WAITING = 4096
UVICORN_GRACE_S = 2.0


def merged_engine_options(args, cli_options: dict) -> dict:
    """Config-file [engine] values, overridden by the flags given (`cli/engine.py`)."""
    options = engine_options_from_toml(getattr(args, "config", None))
    for key, value in cli_options.items():
        if key == "lanes":  # per setting: flags over the file
            for lane, settings in value.items():
                options.setdefault("lanes", {}).setdefault(lane, {}).update(settings)
        else:
            options[key] = value
    return options


def server_settings(args) -> ServerSettings:
    flags = dict(
        host=args.host,
        port=args.port,
        accounts_path=getattr(args, "accounts", None),
        database=getattr(args, "database", None),
        served_model_name=getattr(args, "served_model_name", None),
        api_key=getattr(args, "api_key", None),
        allowed_origins=getattr(args, "allowed_origins", None),
        log_level=getattr(args, "log_level", None),
        log_format=getattr(args, "log_format", None),
    )
    settings = ServerSettings.from_toml(getattr(args, "config", None), **flags)
    if settings.log_level not in LOG_LEVELS:
        raise ValueError(f"[server] log_level = {settings.log_level!r}: use one of {LOG_LEVELS}")
    if not 0 < settings.port < 65536:
        raise ValueError(f"[server] port = {settings.port}: use 1 to 65535")
    return settings


def engine_config(args, engine_options: dict):
    """The EngineConfig to load, every value checked that can be without loading."""
    from expresslane.config import EngineConfig
    from expresslane.lanes import build_lanes

    options = merged_engine_options(args, engine_options)
    check_types(EngineConfig, options, "engine")
    model = args.model or options.pop("model", None)
    options.pop("model", None)
    options.setdefault("max_queue_seconds", SERVE_MAX_QUEUE_SECONDS)
    options.setdefault("max_waiting", SERVE_MAX_WAITING)
    config = EngineConfig.from_options(model, options)
    build_lanes(config.lanes)
    if model and not args.model and model_dir_problem(model):
        raise ValueError(f"[engine] model: {model_dir_problem(model)}")
    problem = device_problem(config.device)
    if problem:
        where = "argument --device" if args.device is not None else "[engine] device"
        raise ValueError(f"{where}: {problem}")
    return config


def _load(config):
    """The started engine (its calibration kept, or measured between requests), or None
    after saying why not."""
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine
    from expresslane.errors import ExpresslaneError

    try:
        engine = AsyncEngine(LLMEngine(config), serve_while_calibrating=True)
    except (ExpresslaneError, OSError, ValueError, KeyError) as e:
        fail(PROG, f"cannot load the model: {e}")
        return None
    while not engine.ready.wait(1.0):
        if not engine.is_alive():
            fail(PROG, "the engine stopped while starting")
            return None
    return engine


def serve(args, engine_options: dict) -> int:
    """Load the model, then serve until SIGINT/SIGTERM; then the server drains
    (`lifecycle.py`): new work gets 503, in-flight requests get `graceful_shutdown_seconds` to
    finish, and responses still running then end incomplete, stored and billed."""
    from expresslane.server.database import DatabaseUnavailable, check

    try:
        settings = server_settings(args)
        config = engine_config(args, engine_options)
        check(settings.database)  # the shared database answers (and its driver is installed)
        sock = bind(settings.host, settings.port)
    except (OSError, ValueError, DatabaseUnavailable) as e:
        return fail(PROG, str(e))
    configure_logging(settings.log_level, settings.log_format)
    try:
        engine = _load(config)
        if engine is None:
            return 2
        try:
            _run(engine, settings, sock)
        finally:
            engine.shutdown()
    finally:
        sock.close()
    return 0


def _run(engine, settings: ServerSettings, sock) -> None:
    import uvicorn

    from expresslane.server.app import create_app
    from expresslane.server.lifecycle import DrainingServer

    # The engine thread holds the GIL between tensor ops; by default a waiting thread gets it
    # only after 5 ms, which would delay every streamed token by up to that much.
    sys.setswitchinterval(0.0005)
    app = create_app(engine, settings)
    log.info(
        "serving %s on http://%s:%d/v1 (playground: http://%s:%d/)",
        app.state.server.model_name,
        settings.host,
        settings.port,
        settings.host,
        settings.port,
    )
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's records go through the handler configure_logging set
        access_log=False,  # request_log.py writes one line per request instead
        timeout_graceful_shutdown=UVICORN_GRACE_S,  # after the drain: what is left is closing
    )
    DrainingServer(config, app.state.server, app.state.lifecycle).run(sockets=[sock])
