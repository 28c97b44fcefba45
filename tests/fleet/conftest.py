"""The fleet's tests share one real PostgreSQL server (`tests/postgres.py`)."""

from tests.postgres import postgres_url  # noqa: F401  (fixture)
