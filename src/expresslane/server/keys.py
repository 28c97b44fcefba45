"""API keys and their plans, in the accounts database (SQLite, or PostgreSQL: `database.py`).

A key is shown once, when created; only its SHA-256 is stored. Each key has a plan: the tiers it
may use, its default tier (what `service_tier: "auto"` means for it), requests/min and
tokens/min per tier, an optional monthly token quota, and what happens when the tier it asks
for is unavailable (lane full, or a tier it lacks): `queue` (wait in the lane; a tier it lacks is
still refused), `downgrade` (served by the next lane down it may use, or for a tier it lacks by
its default tier; echoed in the response) or `reject`.
With no key created at all the server runs in open local mode: anyone may use every tier.
An operator key (`serve --api-key`, or a plan with `operator: true`) also sees what concerns
every tenant: per-key metrics, `/fleet/status`, the fleet's replica headers.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass, field

from expresslane.lanes import LANE_NAMES
from expresslane.server.database import Database
from expresslane.server.database import connect as connect  # the accounts database, opened
from expresslane.server.migrations import Migration, migrate

KEY_PREFIX = "el-"
POLICIES = ("queue", "downgrade", "reject")
OPEN_ACCESS_ID = "local"  # the id of the key every request has in open local mode
OPERATOR_KEY_ID = "api-key"  # the id of `serve --api-key`'s key (accounts.SERVER_KEY)
LOCAL_OWNER = "local"  # who owns what is made in open local mode (and rows older than owners)

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    hint TEXT NOT NULL,
    plan TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
)
"""
MIGRATIONS = [Migration(1, (SCHEMA,))]


@dataclass
class TierLimits:
    rpm: int | None = None  # requests per minute; None: unlimited
    tpm: int | None = None  # tokens (prompt + output) per minute; None: unlimited


@dataclass
class Plan:
    tiers: list[str] = field(default_factory=lambda: ["default", "flex"])
    default_tier: str = "default"
    limits: dict[str, TierLimits] = field(default_factory=dict)  # tier -> limits
    monthly_tokens: int | None = None
    when_unavailable: str = "queue"
    regions: list[str] | None = None  # a fleet's regions it may be served in; None: any
    operator: bool = False  # sees every tenant's metrics and where requests ran

    def __post_init__(self):
        bad = sorted(set(self.tiers) - set(LANE_NAMES))
        if bad or not self.tiers:
            raise ValueError(f"unknown tier(s) {bad}; tiers are {list(LANE_NAMES)}")
        if self.default_tier not in self.tiers:
            raise ValueError(f"the default tier {self.default_tier!r} is not in {self.tiers}")
        if self.when_unavailable not in POLICIES:
            raise ValueError(f"when_unavailable must be one of {list(POLICIES)}")
        self.limits = {
            t: v if isinstance(v, TierLimits) else TierLimits(**v) for t, v in self.limits.items()
        }

    def limits_for(self, tier: str) -> TierLimits:
        return self.limits.get(tier, TierLimits())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls(**json.loads(text))


@dataclass
class ApiKey:
    id: str
    name: str
    hint: str  # the first characters, to recognize a key in listings
    plan: Plan
    created_at: float
    revoked_at: float | None = None

    @property
    def owner(self) -> str:
        """Whose stored responses (and cached prefixes) this key's requests may reach: every key
        created under one name shares them; open local mode is one owner, `LOCAL_OWNER`. The
        `key:` prefix keeps a key's name from ever equalling `LOCAL_OWNER`."""
        return LOCAL_OWNER if self.id == OPEN_ACCESS_ID else f"key:{self.name}"

    @property
    def operator(self) -> bool:
        """The server's operator: `serve --api-key`'s key, or a key whose plan says so."""
        return self.id == OPERATOR_KEY_ID or self.plan.operator


OPEN_ACCESS = ApiKey(
    id=OPEN_ACCESS_ID,
    name="open local mode",
    hint="",
    plan=Plan(tiers=list(LANE_NAMES), when_unavailable="queue"),
    created_at=0.0,
)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    def __init__(self, db: Database):
        self.db = db
        migrate(db, "keys", MIGRATIONS)
        self._has_keys, self._has_keys_at = False, float("-inf")

    def create(self, name: str, plan: Plan) -> tuple[ApiKey, str]:
        """A new key; returns it and its secret (the only time the secret is available)."""
        self._has_keys_at = float("-inf")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey("key_" + secrets.token_hex(6), name, secret[:8], plan, time.time())
        self.db.execute(
            "INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, NULL)",
            (key.id, name, _hash(secret), key.hint, plan.to_json(), key.created_at),
        )
        return key, secret

    def has_keys(self) -> bool:
        """Whether any key exists; asked of every request in open mode, so the answer is
        kept for a second (keys made by `expresslane keys` meanwhile count from then on)."""
        now = time.monotonic()
        if now - self._has_keys_at > 1.0:
            row = self.db.execute("SELECT 1 FROM api_keys LIMIT 1").one()
            self._has_keys, self._has_keys_at = row is not None, now
        return self._has_keys

    def lookup(self, secret: str) -> ApiKey | None:
        """The active key with this secret, or None."""
        row = self.db.execute(
            "SELECT id, name, hint, plan, created_at, revoked_at FROM api_keys "
            "WHERE hash = ? AND revoked_at IS NULL",
            (_hash(secret),),
        ).one()
        return None if row is None else _key(row)

    def list(self) -> list[ApiKey]:
        rows = self.db.execute(
            "SELECT id, name, hint, plan, created_at, revoked_at FROM api_keys ORDER BY created_at"
        ).rows
        return [_key(r) for r in rows]

    def revoke(self, id_or_name: str) -> int:
        """Revoke the key with this id (or every active key with this name); returns how many."""
        return self.db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE (id = ? OR name = ?) AND revoked_at IS NULL",
            (time.time(), id_or_name, id_or_name),
        ).rowcount


def _key(row) -> ApiKey:
    return ApiKey(row[0], row[1], row[2], Plan.from_json(row[3]), row[4], row[5])
