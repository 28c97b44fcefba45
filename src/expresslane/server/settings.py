"""Server settings: where to listen, where to keep stored responses, limits.

`database`, a PostgreSQL URL, puts API keys, the ledger, stored responses and rate limits in
that database, shared by every server given it (a fleet's ingress processes); without it they
are this process's SQLite files (`store_path`, `accounts_path`).

They come from defaults, then the `[server]` table of the TOML file given with
`expresslane serve --config FILE`, then the command-line flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from expresslane.errors import InvalidRequestError
from expresslane.server.database import is_postgres
from expresslane.server.preflight import check_types

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def data_file(env_var: str, name: str) -> str:
    """`$env_var`, else `$XDG_DATA_HOME/expresslane/name` (default ~/.local/share/...)."""
    env = os.environ.get(env_var)
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return os.path.join(base, "expresslane", name)


def default_store_path() -> str:
    return data_file("EXPRESSLANE_STORE", "responses.sqlite")


def default_accounts_path() -> str:
    """API keys and the usage ledger."""
    return data_file("EXPRESSLANE_ACCOUNTS", "accounts.sqlite")


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model directory's name
    store_path: str | None = None  # SQLite file; ":memory:" keeps nothing; None: default path
    accounts_path: str | None = None  # API keys + usage ledger (SQLite); None: default path
    database: str | None = None  # postgresql://...: keys, ledger, store, limits shared there
    websocket_max_connection_seconds: float = 3600.0  # WebSocket mode connection lifetime
    websocket_max_queued_messages: int = 16  # sent ahead of the one running; more: closed
    # Browser origins (the Origin header) that may open WebSocket mode ("*": any). None: any
    # with API keys configured (a key is needed anyway), only the server's own in open mode.
    websocket_allowed_origins: list[str] | None = None
    metrics_per_key: bool = False  # /metrics by API key for any scraper (else: operator keys)
    replica_headers: bool = False  # a fleet's x-expresslane-replica for any key (else: operators)
    max_body_bytes: int = 16 * 2**20  # request bodies larger than this get 413
    max_input_items: int = 4096  # messages, input items or prompts in one request
    max_tools: int = 128  # tools declared in one request
    max_prompt_chars: int | None = None  # None: what the context can hold (limits.py)
    max_output_tokens: int | None = None  # the most any request may ask; None: the context
    # a max_tokens past the context: lowered to what fits (as llama.cpp does), else a 400 (as
    # OpenAI and vLLM answer); agents that send a fixed large one (opencode: 32000) need it
    clamp_max_tokens: bool = False
    max_queued_per_lane: int | None = None  # waiting beyond max_batch; None: max_batch
    max_in_flight_per_key: int | None = 256  # requests of one key running or waiting
    share_prefix_cache: bool = False  # with API keys, cached prefixes serve all owners
    tool_parser: str = "auto"  # "auto" (from the chat template), hermes, llama3_json, mistral,
    # harmony
    reasoning_parser: str = "auto"  # "auto" (from the chat template), harmony, none
    graceful_shutdown_seconds: float = 30.0  # how long in-flight requests may finish
    background_retention_seconds: float = 600.0  # finished background jobs kept in memory
    background_retention_count: int = 1000  # at most this many of them
    log_level: str = "info"
    log_format: str = "text"  # or "json": one JSON object per log line (`request_log.py`)
    api_key: str | None = None  # a key that may use every tier, besides the accounts' keys
    allowed_origins: list[str] | None = None  # CORS origins ("*": any); None: CORS off

    prices: dict | None = None  # the [prices] table: base prices per 1M tokens

    def resolved_store_path(self) -> str:
        """The response store: the shared database if there is one, else a SQLite file."""
        if is_postgres(self.database):
            return self.database
        return self.store_path or default_store_path()

    def resolved_accounts_path(self) -> str:
        if is_postgres(self.database):
            return self.database
        return self.accounts_path or default_accounts_path()

    @classmethod
    def from_toml(cls, path: str | None, **overrides) -> ServerSettings:
        data: dict = {}
        if path:
            with open(path, "rb") as f:
                try:
                    toml = tomllib.load(f)
                except tomllib.TOMLDecodeError as e:
                    raise ValueError(f"{path} is not valid TOML: {e}") from None
            data = dict(toml.get("server", {}))
            if "prices" in toml:
                data["prices"] = toml["prices"]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown [server] setting(s) {unknown} in {path}; known: {sorted(known)}"
            )
        check_types(cls, data, "server")
        data.update({k: v for k, v in overrides.items() if v is not None})
        if data.get("log_format", "text") not in ("text", "json"):
            raise ValueError(f"[server] log_format = {data['log_format']!r}: use text or json")
        check_database(data.get("database"))
        return cls(**data)


def check_database(database: str | None, where: str = "[server] database =") -> None:
    """A database setting names PostgreSQL (SQLite files are `store_path`/`accounts_path`)."""
    if database and not is_postgres(database):
        raise ValueError(
            f"{where} {database[:40]!r}: use a postgresql:// URL (without it, keys, ledger "
            "and stored responses are SQLite files)"
        )


def engine_options_from_toml(path: str | None) -> dict:
    """The `[engine]` table of the config file (EngineConfig fields) plus its `[lanes.*]`
    tables as the `lanes` option, or {}."""
    if not path:
        return {}
    with open(path, "rb") as f:
        toml = tomllib.load(f)
    options = dict(toml.get("engine", {}))
    if "lanes" in toml:
        options["lanes"] = toml["lanes"]
    return options
