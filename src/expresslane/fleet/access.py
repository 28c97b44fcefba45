"""Who may use a fleet's ingress.

An ingress with no API key (none made with `expresslane keys` in its accounts database, no
`[server] api_key`) would serve every tier to anyone who reaches it: it refuses to start
unless the cluster file says `[ingress] open = true`. `expresslane cluster` checks this before
deploying where it can see the ingress's accounts (the shared database, or a local Ray
cluster's files); each ingress replica checks again when it starts. Several ingress replicas
need `[server] database` (cluster_file.py): each would otherwise open an accounts file of its
own node, with its own keys, ledger and limits.
"""

from __future__ import annotations

import os

from expresslane.fleet.cluster_file import ClusterSpec
from expresslane.server.database import connect, is_postgres, redact
from expresslane.server.keys import KeyStore
from expresslane.server.settings import ServerSettings

OPEN_REFUSED = (
    "the ingress has no API key (its accounts at {where} hold none, and [server] has no "
    "api_key), so it would serve every tier to anyone who reaches it: create keys with "
    "`expresslane keys create NAME{db}`, or say `open = true` in [ingress] to run it open"
)


class OpenIngressError(RuntimeError):
    """An ingress without keys whose cluster file does not allow open mode."""


def refuse_open_mode(spec: ClusterSpec, accounts) -> None:
    """Raise OpenIngressError if the ingress (its `Accounts`) would run open without consent."""
    if spec.ingress.open or accounts.api_key or accounts.keys.has_keys():
        return
    raise OpenIngressError(_message(ServerSettings(**spec.server)))


def open_without_consent(spec: ClusterSpec) -> str | None:
    """Before deploying: why the ingress would refuse to start open, or None (allowed, has
    keys, or its accounts are on other machines: a node-local file of a remote Ray cluster)."""
    settings = ServerSettings(**spec.server)
    if spec.ingress.open or settings.api_key:
        return None
    if not is_postgres(settings.database) and os.environ.get("RAY_ADDRESS"):
        return None
    db = connect(settings.resolved_accounts_path())
    try:
        has_keys = KeyStore(db).has_keys()
    finally:
        db.close()
    return None if has_keys else _message(settings)


def _message(settings: ServerSettings) -> str:
    where = redact(settings.resolved_accounts_path())
    db = f" --database {where}" if is_postgres(where) else f" --db {where}"
    return OPEN_REFUSED.format(where=where, db=db)
