"""Store leases on SQLite and PostgreSQL: a store recovers another's unfinished responses only
once that owner's lease has run out (an owner on another host that stopped renewing it), the
owner learns it lost the lease, and a response recovered before its owner ends is billed
once. (Same-host crashes, through real servers: tests/server/test_store_owner.py.)"""

from __future__ import annotations

import time

from expresslane.lanes import build_lanes
from expresslane.server.accounts import Accounts
from expresslane.server.database import connect
from expresslane.server.durability import recover
from expresslane.server.metering import Prices
from expresslane.server.store import Origin, ResponseStore
from expresslane.server.store_lease import LEASE_SECONDS

from .test_stores import response, row


def test_only_a_gone_owners_unfinished_responses_are_recovered(database):
    owner, other = ResponseStore(database), ResponseStore(database)
    try:
        owner.put(response("running", "in_progress"), [], [], Origin(request_id="req_run"))
        owner.flush()
        assert other.unfinished() == []  # its owner renews its lease
        db = connect(database)
        db.execute(  # as if it ran on another host and stopped renewing
            "UPDATE server_leases SET host = 'elsewhere', heartbeat_at = ? WHERE server_id = ?",
            (time.time() - LEASE_SECONDS - 1, owner.lease.server_id),
        )
        db.close()
        assert [s.response["id"] for s in other.unfinished()] == ["running"]
        owner.lease.renew()
        assert owner.lease.lost
    finally:
        owner.close()
        other.close()


def test_a_request_id_is_billed_once_whatever_the_order(database):
    accounts = Accounts(database, Prices(), build_lanes(None))
    store = ResponseStore(database)
    try:
        store.put(response("resp", "in_progress"), [], [], Origin(request_id="req_1"))
        db = connect(database)
        db.execute("DELETE FROM server_leases WHERE server_id = ?", (store.lease.server_id,))
        db.close()
        assert recover(store, accounts) == 1  # billed by the recovery first
        assert not accounts.ledger.record_once(row("req_1"))  # then by its owner: refused
        assert [r["status"] for r in accounts.ledger.rows("req_1")] == ["interrupted"]
    finally:
        store.close()
        accounts.close()
