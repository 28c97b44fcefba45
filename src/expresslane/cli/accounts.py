"""`expresslane keys create|list|revoke` and `expresslane usage`: the accounts database (a
SQLite file, or with `--database URL` the PostgreSQL database a fleet's servers share)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

from expresslane.lanes import LANE_NAMES
from expresslane.server.keys import POLICIES


def _db(args):
    """The accounts database the command names, opened."""
    from expresslane.server.database import DatabaseUnavailable, connect
    from expresslane.server.settings import check_database, default_accounts_path

    if args.database:
        try:
            check_database(args.database, "--database")
        except ValueError as e:
            raise DatabaseUnavailable(str(e)) from None
        return connect(args.database)
    return connect(args.db or default_accounts_path())


def _reports_database_errors(command):
    """A database that cannot be opened is one line and exit status 2, not a traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from expresslane.server.database import DatabaseUnavailable

        try:
            return command(args)
        except DatabaseUnavailable as e:
            name = command.__name__.removeprefix("cmd_")
            print(f"expresslane {name}: error: {e}", file=sys.stderr)
            return 2

    return run


def _limit(text: str) -> tuple[str, dict]:
    """'ultrafast:rpm=10,tpm=5000' -> ('ultrafast', {'rpm': 10, 'tpm': 5000})."""
    tier, _, spec = text.partition(":")
    limits = {}
    for part in filter(None, spec.split(",")):
        name, _, value = part.partition("=")
        if name not in ("rpm", "tpm") or not value.isdigit():
            raise SystemExit(f"--limit {text!r}: expected TIER:rpm=N,tpm=N")
        limits[name] = int(value)
    if tier not in LANE_NAMES:
        raise SystemExit(f"--limit {text!r}: unknown tier {tier!r}; tiers are {LANE_NAMES}")
    return tier, limits


@_reports_database_errors
def cmd_keys(args: argparse.Namespace) -> int:
    from expresslane.server.keys import KeyStore

    actions = {"create": _create_key, "list": _list_keys, "revoke": _revoke_key}
    return actions[args.action](KeyStore(_db(args)), args)


def _create_key(store, args: argparse.Namespace) -> int:
    from expresslane.server.keys import Plan

    tiers = args.tiers.split(",")
    limits = {t: {"rpm": args.rpm, "tpm": args.tpm} for t in tiers}
    for text in args.limit:
        tier, values = _limit(text)
        limits.setdefault(tier, {}).update(values)
    try:
        plan = Plan(
            tiers=tiers,
            default_tier=args.default_tier or tiers[0],
            limits=limits,
            monthly_tokens=args.monthly_tokens,
            when_unavailable=args.when_unavailable,
            regions=args.regions.split(",") if args.regions else None,
            operator=args.operator,
        )
    except ValueError as e:
        print(f"expresslane keys create: {e}", file=sys.stderr)
        return 2
    key, secret = store.create(args.name, plan)
    if args.json:
        print(json.dumps({"id": key.id, "name": key.name, "key": secret}))
    else:
        print(f"created {key.id} ({key.name}); the key is shown only now:\n{secret}")
    return 0


def _list_keys(store, args: argparse.Namespace) -> int:
    keys = store.list()
    if args.json:
        rows = [
            {
                "id": k.id,
                "name": k.name,
                "hint": k.hint,
                "plan": json.loads(k.plan.to_json()),
                "created_at": k.created_at,
                "revoked_at": k.revoked_at,
            }
            for k in keys
        ]
        print(json.dumps(rows, indent=2))
        return 0
    _print_table(
        ["id", "name", "key", "tiers", "default", "when unavailable", "regions", "status"],
        [
            [
                k.id,
                k.name,
                k.hint + "…",
                ",".join(k.plan.tiers),
                k.plan.default_tier,
                k.plan.when_unavailable,
                ",".join(k.plan.regions or ["any"]),
                "revoked" if k.revoked_at else "active",
            ]
            for k in keys
        ],
        "API keys",
    )
    return 0


def _revoke_key(store, args: argparse.Namespace) -> int:
    n = store.revoke(args.key)
    if n == 0:
        print(f"expresslane keys revoke: no active key {args.key!r}", file=sys.stderr)
        return 1
    print(f"revoked {n} key(s)")
    return 0


@_reports_database_errors
def cmd_usage(args: argparse.Namespace) -> int:
    from expresslane.server.metering import Ledger, month_start

    since = month_start() if args.month else time.time() - args.days * 86400 if args.days else 0
    ledger = Ledger(_db(args))
    if args.promise:
        return _print_attainment(ledger.attainment(args.window, since), args.json)
    rows = ledger.usage(since)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    _print_table(
        [
            "key",
            "tier",
            "requests",
            "cancelled",
            "input",
            "cached",
            "output",
            "cost",
            "refunded",
            "TTFT",
            "promise kept",
        ],
        [
            [
                r["key_id"],
                r["tier"],
                r["requests"],
                r["cancelled"],
                r["input_tokens"],
                r["cached_tokens"],
                r["output_tokens"],
                f"{r['cost']:.6f}",
                f"{r['refund'] or 0:.6f}",
                "-" if r["mean_ttft_s"] is None else f"{r['mean_ttft_s'] * 1000:.0f} ms",
                f"{r['promise_kept']}/{r['promise_judged']}" if r["promise_judged"] else "-",
            ]
            for r in rows
        ],
        "usage per key and tier",
    )
    return 0


def _print_attainment(rows: list[dict], as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    _print_table(
        ["key", "tier", "window (UTC)", "kept", "attainment", "median tok/s", "promised", "refund"],
        [
            [
                r["key_id"],
                r["tier"],
                time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["window_start"])),
                f"{r['kept']}/{r['judged']}",
                f"{r['attainment']:.1%}",
                "-"
                if r["median_delivered_tokens_per_s"] is None
                else f"{r['median_delivered_tokens_per_s']:.1f}",
                f"{r['promised_tokens_per_s']:.1f}",
                f"{r['refund']:.6f}",
            ]
            for r in rows
        ],
        "promise attainment per key, tier and window",
    )
    return 0


def _print_table(columns: list[str], rows: list[list], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(str(v) for v in r))
    Console().print(table)


def add_account_commands(sub) -> None:
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument(
        "--db",
        default=None,
        help="accounts database (default: $EXPRESSLANE_ACCOUNTS or "
        "~/.local/share/expresslane/accounts.sqlite, as `serve` uses)",
    )
    db.add_argument(
        "--database",
        metavar="URL",
        default=os.environ.get("EXPRESSLANE_DATABASE"),
        help="the postgresql:// database `serve --database` shares (default: "
        "$EXPRESSLANE_DATABASE; without it, the SQLite file of --db)",
    )
    k = sub.add_parser("keys", help="create, list and revoke API keys")
    actions = k.add_subparsers(dest="action", required=True)
    c = actions.add_parser("create", parents=[db], help="create a key (printed once)")
    c.add_argument("name")
    c.add_argument("--tiers", default="default,flex", help="allowed tiers, comma-separated")
    c.add_argument("--default-tier", default=None, help="what 'auto' means (default: first)")
    c.add_argument("--rpm", type=int, default=None, help="requests/min per tier")
    c.add_argument("--tpm", type=int, default=None, help="tokens/min per tier")
    c.add_argument(
        "--limit", action="append", default=[], help="per tier: TIER:rpm=N,tpm=N (repeatable)"
    )
    c.add_argument("--monthly-tokens", type=int, default=None)
    c.add_argument(
        "--when-unavailable",
        choices=POLICIES,
        default="queue",
        help="when the tier asked for is full (or not allowed): wait, serve at the default "
        "tier, or refuse",
    )
    c.add_argument(
        "--regions",
        default=None,
        help="a fleet's regions this key may be served in, comma-separated (default: any)",
    )
    c.add_argument(
        "--operator",
        action="store_true",
        help="the server's operator: sees every key's metrics, where requests ran and the "
        "fleet's status",
    )
    c.add_argument("--json", action="store_true")
    ls = actions.add_parser("list", parents=[db], help="list keys")
    ls.add_argument("--json", action="store_true")
    r = actions.add_parser("revoke", parents=[db], help="revoke a key by id or name")
    r.add_argument("key")
    k.set_defaults(func=cmd_keys)

    _add_usage_command(sub, db)


def _add_usage_command(sub, db: argparse.ArgumentParser) -> None:
    u = sub.add_parser(
        "usage", parents=[db], help="usage and cost per key and tier, from the ledger"
    )
    u.add_argument("--json", action="store_true")
    u.add_argument("--month", action="store_true", help="this calendar month (UTC) only")
    u.add_argument("--days", type=float, default=None, help="the last N days only")
    u.add_argument(
        "--promise",
        action="store_true",
        help="how each key's requests kept their tier's promise, per window",
    )
    u.add_argument(
        "--window", type=float, default=300.0, help="with --promise: window seconds (300)"
    )
    u.set_defaults(func=cmd_usage)
