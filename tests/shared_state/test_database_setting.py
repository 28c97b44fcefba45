"""The `database` setting: the config file, the flags, what it resolves to, and the one-line
errors for a database that is not PostgreSQL, cannot be reached, or lacks its driver."""

from __future__ import annotations

import sys

import pytest

from expresslane.cli import main as cli
from expresslane.server.database import DatabaseUnavailable, connect, redact, to_psycopg
from expresslane.server.settings import ServerSettings

from ..ports import free_port

URL = "postgresql://fleet:secret@db.internal:5432/expresslane"


def test_the_config_file_names_the_shared_database(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text(f'[server]\ndatabase = "{URL}"\nstore_path = "/nowhere.sqlite"\n')
    settings = ServerSettings.from_toml(str(config))
    assert settings.database == URL
    assert settings.resolved_store_path() == settings.resolved_accounts_path() == URL
    plain = ServerSettings.from_toml(None, store_path="s.sqlite", accounts_path="a.sqlite")
    assert (plain.resolved_store_path(), plain.resolved_accounts_path()) == ("s.sqlite", "a.sqlite")
    config.write_text('[server]\ndatabase = "state.sqlite"\n')
    with pytest.raises(ValueError, match="postgresql://"):
        ServerSettings.from_toml(str(config))


def test_messages_never_show_the_password():
    assert redact(URL) == "postgresql://fleet:***@db.internal:5432/expresslane"
    assert redact("postgres://db/x") == "postgres://db/x"


def test_sql_is_translated_for_psycopg():
    assert to_psycopg("SELECT ? WHERE a LIKE '%' || ?") == "SELECT %s WHERE a LIKE '%%' || %s"
    assert (
        to_psycopg("VALUES (:key, CAST(:n AS INTEGER))")
        == "VALUES (%(key)s, CAST(%(n)s AS INTEGER))"
    )


def test_without_psycopg_a_postgres_url_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg now raises ImportError
    with pytest.raises(DatabaseUnavailable, match=r"expresslane\[postgres\]") as e:
        connect(URL)
    assert "secret" not in str(e.value) and "\n" not in str(e.value)


def test_an_unreachable_database_is_one_line_before_the_model_loads(capsys):
    url = f"postgresql://postgres:pw@127.0.0.1:{free_port()}/x"
    assert cli(["serve", "--database", url, "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("expresslane serve: error: cannot connect to postgresql://postgres:***@")
    assert "\n" not in err and ":pw@" not in err
    assert cli(["keys", "list", "--database", url]) == 2
    assert capsys.readouterr().err.startswith("expresslane keys: error: cannot connect")
    assert cli(["usage", "--database", "accounts.sqlite"]) == 2
    assert "--database 'accounts.sqlite': use a postgresql:// URL" in capsys.readouterr().err
