"""`expresslane serve`: its flags, named as vLLM names them where they mean the same thing.

Each flag has a config-file twin (`--config FILE`): server flags in `[server]`, engine flags in
`[engine]`; a flag given on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import os

from expresslane.cli.arg_types import LOG_LEVELS, existing_file, non_negative_int, origins, port


def cmd_serve(args: argparse.Namespace) -> int:
    from expresslane.cli.engine import engine_options
    from expresslane.cli.serving import serve

    return serve(args, engine_options(args))


def add_serve_command(sub, engine_args) -> None:
    s = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Serve the OpenAI-compatible API (and a playground page at /). Flags "
        "override the config file's [server] and [engine] settings of the same name.",
    )
    engine_args(s)
    _listen_args(s)
    _state_args(s)
    _access_args(s)
    s.set_defaults(func=cmd_serve)


def _listen_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--seed",
        dest="engine_seed",
        metavar="N",
        type=non_negative_int,
        default=None,
        help="the engine's random seed: requests without a seed of their own sample repeatably",
    )
    s.add_argument("--host", default=None, help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=port, default=None, help="port to listen on (default: 8000)")
    s.add_argument(
        "--config",
        metavar="FILE",
        type=existing_file,
        default=None,
        help="TOML config file with [server], [engine], [lanes.*] and [prices] tables",
    )
    s.add_argument(
        "--log-level", choices=LOG_LEVELS, default=None, help="log level (default: info)"
    )
    s.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="one line per request as text, or as a JSON object per line (default: text)",
    )


def _state_args(s: argparse.ArgumentParser) -> None:
    """Where keys, ledger and stored responses live."""
    s.add_argument(
        "--accounts",
        metavar="PATH",
        default=None,
        help="API keys + usage ledger (SQLite; default: $EXPRESSLANE_ACCOUNTS or "
        "~/.local/share/expresslane/accounts.sqlite)",
    )
    s.add_argument(
        "--database",
        metavar="URL",
        default=os.environ.get("EXPRESSLANE_DATABASE"),
        help="a postgresql:// URL: API keys, ledger, stored responses and rate limits live in "
        "that database, shared by every server given it (needs the postgres extra; default: "
        "$EXPRESSLANE_DATABASE, else SQLite files)",
    )


def _access_args(s: argparse.ArgumentParser) -> None:
    """Who may call the API, and the model id they name."""
    s.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model id clients send and /v1/models lists (default: the directory's name)",
    )
    s.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("EXPRESSLANE_API_KEY"),
        help="require 'Authorization: Bearer KEY' with this key (every tier, no limits), "
        "besides the keys of `expresslane keys` (default: $EXPRESSLANE_API_KEY)",
    )
    s.add_argument(
        "--allowed-origins",
        type=origins,
        default=None,
        metavar="ORIGINS",
        help="CORS: origins whose browser pages may call the API, comma-separated or a JSON "
        "list; '*' for any (default: none, CORS off)",
    )
