"""Acknowledged means durable: stored responses are created back to back against a real
`expresslane serve`, which is killed with SIGKILL at a random moment (or right after an answer
reached the client), then restarted on the same store; every id the client received answers
200 (completed, incomplete or failed: never 404), and each has at most one ledger row: a
completed one's tokens are its stored usage; one the restart marked incomplete was billed
either then, for what it had saved, or at its end, just before the kill took its final state.

`test_acknowledged_ids_survive_kill_9` runs a few kill points on SQLite in the default run; the
slow variant runs `EXPRESSLANE_KILL_POINTS` (default 100) on SQLite and on PostgreSQL:
`python -m pytest -m slow tests/server/test_crash_points.py`.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import threading

import httpx
import pytest

from tests.postgres import fresh_postgres, postgres_url  # noqa: F401  (fixtures)

from .test_durability import MODEL, Serve

ENDED = {"completed", "incomplete", "failed"}


class Creator(threading.Thread):
    """Creates stored background responses as fast as the server answers; keeps the ids it was
    given and signals each one."""

    def __init__(self, url: str, rng: random.Random):
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=url, timeout=30)
        self.rng = rng
        self.ids: list[str] = []
        self.answered = threading.Semaphore(0)

    def run(self) -> None:
        while True:
            body = {"model": MODEL, "input": "hi", "background": True, "temperature": 0}
            body["max_output_tokens"] = self.rng.choice([1, 4, 16, 64])
            try:
                r = self.http.post("/v1/responses", json=body)
            except httpx.TransportError:
                return  # the server is gone
            if r.status_code != 200:
                return
            self.ids.append(r.json()["id"])
            self.answered.release()


def kill_point(server: Serve, rng: random.Random) -> list[str]:
    """Create until a kill: after the k-th answer at once, or at a random moment."""
    creator = Creator(server.url, rng)
    creator.start()
    for _ in range(rng.randint(1, 12)):
        assert creator.answered.acquire(timeout=120), "no answer from the server"
    if rng.random() < 0.5:  # else: right after that answer
        threading.Event().wait(rng.uniform(0, 0.2))
    server.stop(signal.SIGKILL)
    creator.join(60)
    creator.http.close()
    return creator.ids


def ledger_rows(server: Serve, database: str | None) -> dict[str, list[tuple]]:
    sql = "SELECT request_id, input_tokens, output_tokens FROM ledger"
    if database:
        import psycopg

        with psycopg.connect(database) as db:
            rows = db.execute(sql).fetchall()
    else:
        db = sqlite3.connect(server.accounts, timeout=30)
        try:
            rows = db.execute(sql).fetchall()
        finally:
            db.close()
    out: dict[str, list[tuple]] = {}
    for rid, i, o in rows:
        out.setdefault(rid, []).append((i, o))
    return out


def check_all(server: Serve, ids: list[str], database: str | None) -> None:
    billed = ledger_rows(server, database)
    for rid in ids:
        r = server.http.get(f"/v1/responses/{rid}")
        assert r.status_code == 200, f"acknowledged {rid} is lost: {r.status_code} {r.text}"
        response = r.json()
        if response["status"] not in ENDED:  # restarted runs finish in the new server
            continue
        rows = billed.get(rid, [])
        assert len(rows) <= 1, f"{rid} billed {len(rows)} times"
        used = response.get("usage")
        if response["status"] == "completed":
            assert rows == [(used["input_tokens"], used["output_tokens"])], (rid, response)
        elif rows and used:  # billed at its end, whose stored state the kill may have taken:
            assert rows[0][1] >= used["output_tokens"], (rid, rows, response)  # (then: none)


def run_kill_points(root, points: int, seed: int, database: str | None = None) -> int:
    rng = random.Random(seed)
    model = _model(root)
    acknowledged: list[str] = []
    server = Serve(model, root, database=database)
    try:
        for _ in range(points):
            acknowledged += kill_point(server, rng)
            server = Serve(model, root, database=database)
            check_all(server, acknowledged, database)
    finally:
        server.stop(signal.SIGTERM)
    return len(acknowledged)


def _model(root):
    from ..conftest import make_checkpoint

    path = root / "model"
    return path / "llama" if path.exists() else make_checkpoint(path, "llama")


def test_acknowledged_ids_survive_kill_9(tmp_path):
    assert run_kill_points(tmp_path, points=3, seed=1) > 0


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_acknowledged_ids_survive_many_kill_points(tmp_path, request, store):
    points = int(os.environ.get("EXPRESSLANE_KILL_POINTS", "100"))
    database = request.getfixturevalue("fresh_postgres") if store == "postgres" else None
    n = run_kill_points(tmp_path, points=points, seed=2, database=database)
    print(f"{store}: {points} kill points, {n} acknowledged ids, none lost")
