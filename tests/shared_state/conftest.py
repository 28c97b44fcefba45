"""Shared state (keys, ledger, stored responses, rate limits) on SQLite and on a real
PostgreSQL server (`tests/postgres.py`)."""

from __future__ import annotations

import pytest

from tests.postgres import fresh_postgres, postgres_url  # noqa: F401  (fixtures)


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path) -> str:
    """A fresh database of each backend: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "state.sqlite")
    return request.getfixturevalue("fresh_postgres")
