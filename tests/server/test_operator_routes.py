"""What only the operator sees, on a real server started with `--api-key` (the operator's key)
and a tenant key: a non-ASCII bearer token is a 401 in the OpenAI error shape (not a 500).
(`/metrics` per key only for the operator: tests/server/test_promise.py; `/fleet/status`:
tests/fleet/test_fleet.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread
from .test_accounts import run_cli

OPERATOR = "op-secret"


@pytest.fixture(scope="module")
def tenant_server(engine, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("operator") / "accounts.sqlite")
    tenant = json.loads(run_cli("keys", "create", "tenant", "--json", "--db", db))["key"]
    settings = ServerSettings(store_path=":memory:", accounts_path=db, api_key=OPERATOR)
    with ServerThread(create_app(engine, settings)) as s:
        yield s, tenant


@pytest.mark.parametrize("token", ["clé", "密钥", "el-\u00a0x"])
def test_a_non_ascii_bearer_token_is_a_401(tenant_server, token):
    server, _ = tenant_server
    headers = {"authorization": f"Bearer {token}".encode()}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] and error["message"]


def test_keys_create_operator_makes_an_operator_key(tmp_path):
    from expresslane.server.database import connect
    from expresslane.server.keys import KeyStore

    db = str(tmp_path / "accounts.sqlite")
    made = {
        name: json.loads(run_cli("keys", "create", name, *flags, "--json", "--db", db))["key"]
        for name, flags in (("ops", ["--operator"]), ("tenant", []))
    }
    store = KeyStore(connect(db))
    assert store.lookup(made["ops"]).operator and not store.lookup(made["tenant"]).operator
