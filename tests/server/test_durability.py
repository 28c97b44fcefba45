"""Durability and graceful stop of a real `expresslane serve` process, on real SQLite files.

- kill -9 with four stored responses in flight (two background, two streamed): after a
  restart each is `incomplete` with the output it had saved, and the ledger (and `expresslane
  usage --json`) bills its tokens, once, however often the server restarts.
- SIGTERM: `/health` stays 200, `/ready` and new work answer 503 while the requests in flight
  finish; with a short graceful period, what still runs then ends incomplete and billed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from expresslane.cli import main as cli

from ..conftest import make_checkpoint
from ..ports import free_port

MODEL = "llama"
LONG = {"max_output_tokens": 3500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """The tiny Llama with a 4096-token context: room for responses that run for seconds."""
    return make_checkpoint(
        tmp_path_factory.mktemp("long_ctx"), "llama", max_position_embeddings=4096
    )


class Serve:
    """`expresslane serve` in a subprocess, on a store and an accounts file in `root`."""

    def __init__(
        self, model: Path, root: Path, graceful_s: float = 30.0, database: str | None = None
    ):
        """`database`: a PostgreSQL URL for the store, keys and ledger (else SQLite files)."""
        self.store = root / "responses.sqlite"
        self.accounts = root / "accounts.sqlite"
        config = root / "expresslane.toml"
        shared = f'database = "{database}"\n' if database else ""
        config.write_text(
            f'[server]\nstore_path = "{self.store}"\ngraceful_shutdown_seconds = {graceful_s}\n'
            + shared
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(root / f"serve-{self.port}.log", "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "expresslane.cli", "serve", "--model", str(model)]
        cmd += ["--port", str(self.port), "--config", str(config)]
        cmd += ["--accounts", str(self.accounts), "--kv-cache-memory-gb", "0.1"]
        env = {k: v for k, v in os.environ.items() if k != "EXPRESSLANE_ACCOUNTS"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"expresslane serve exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if self.http.get("/ready").status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError("expresslane serve did not become ready")

    def stop(self, sig: int | None = signal.SIGKILL) -> int:
        """Send `sig` (None: none) if it still runs, and wait for it to exit."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(120)
        self.http.close()
        self.log.close()
        return code


def create(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **LONG, **body})
    assert r.status_code == 200, r.text
    return r.json()


class Stream(threading.Thread):
    """A streamed store=true response read in the background; keeps its events."""

    def __init__(self, url: str, **body):
        super().__init__(daemon=True)
        self.url, self.body = url, {"model": MODEL, "input": "hi", "stream": True, **LONG, **body}
        self.events: list[dict] = []
        self.started = threading.Event()

    def run(self) -> None:
        with (
            contextlib.suppress(httpx.TransportError),
            httpx.stream("POST", self.url + "/v1/responses", json=self.body, timeout=120) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))
                    self.started.set()
        self.started.set()

    @property
    def id(self) -> str:
        return self.events[0]["response"]["id"]

    @property
    def text(self) -> str:
        return "".join(e["delta"] for e in self.events if e["type"] == "response.output_text.delta")


def saved(store: Path) -> dict[str, dict]:
    """What the store file holds now: id -> (status column, response)."""
    db = sqlite3.connect(store, timeout=30)
    try:
        rows = db.execute("SELECT id, status, response FROM responses").fetchall()
    finally:
        db.close()
    return {rid: {"status": status, **json.loads(r)} for rid, status, r in rows}


def text_of(response: dict) -> str:
    return "".join(
        part.get("text", "")
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def ledger(accounts: Path) -> list[tuple]:
    db = sqlite3.connect(accounts, timeout=30)
    try:
        return db.execute(
            "SELECT request_id, status, input_tokens, output_tokens, cost FROM ledger "
            "ORDER BY request_id"
        ).fetchall()
    finally:
        db.close()


def usage_json(accounts: Path) -> list[dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["usage", "--json", "--db", str(accounts)]) == 0
    return json.loads(out.getvalue())


def wait_until(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill_9_keeps_partial_output_and_bills_it_once(long_llama, tmp_path):
    server = Serve(long_llama, tmp_path)
    try:
        background = [create(server.http, background=True) for _ in range(2)]
        streams = [Stream(server.url) for _ in range(2)]
        for s in streams:
            s.start()
            assert s.started.wait(120) and s.events, "the stream did not start"
        ids = [r["id"] for r in background] + [s.id for s in streams]

        def all_progressed():  # each has committed some output to the file
            rows = saved(server.store)
            return all(i in rows and text_of(rows[i]) for i in ids)

        wait_until(all_progressed, "every response to save progress")
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        server.stop()
    for s in streams:
        s.join(30)
    assert all(r["status"] == "in_progress" for r in saved(server.store).values())
    assert ledger(server.accounts) == []  # nothing had finished

    server = Serve(long_llama, tmp_path)
    try:
        for rid in ids:
            r = server.http.get(f"/v1/responses/{rid}").json()
            assert r["status"] == "incomplete", r
            assert r["incomplete_details"] == {"reason": "server_restarted"}
            assert r["error"]["code"] == "server_restarted"
            assert text_of(r) and 0 < r["usage"]["output_tokens"] < LONG["max_output_tokens"]
        for s in streams:  # what was saved is what the client had been sent, up to the kill
            stored = server.http.get(f"/v1/responses/{s.id}").json()
            assert s.text.startswith(text_of(stored))
        # the partial conversation can be continued
        more = create(server.http, previous_response_id=ids[0], max_output_tokens=2)
        assert more["previous_response_id"] == ids[0]
    finally:
        assert server.stop(signal.SIGTERM) == 0
    billed = [row for row in ledger(server.accounts) if row[1] == "interrupted"]
    stored = saved(server.store)
    assert [row[0] for row in billed] == sorted(ids)
    for rid, _, input_tokens, output_tokens, cost in billed:
        usage = stored[rid]["usage"]
        assert (input_tokens, output_tokens) == (usage["input_tokens"], usage["output_tokens"])
        assert output_tokens > 0 and cost > 0
    (local,) = [u for u in usage_json(server.accounts) if u["tier"] == "default"]
    assert local["interrupted"] == 4
    assert local["output_tokens"] >= sum(row[3] for row in billed)

    # A crash between the ledger row and the store update leaves a billed row unfinished:
    # the next start marks it again and bills nothing more.
    db = sqlite3.connect(server.store)
    db.execute("UPDATE responses SET status = 'in_progress' WHERE id = ?", (ids[2],))
    db.commit()
    db.close()
    before, usage_before = ledger(server.accounts), usage_json(server.accounts)
    server = Serve(long_llama, tmp_path)
    try:
        assert server.http.get(f"/v1/responses/{ids[2]}").json()["status"] == "incomplete"
    finally:
        server.stop(signal.SIGTERM)
    assert ledger(server.accounts) == before
    assert usage_json(server.accounts) == usage_before
    assert saved(server.store)[ids[2]]["status"] == "incomplete"


def test_sigterm_drains_then_exits(long_llama, tmp_path):
    server = Serve(long_llama, tmp_path, graceful_s=120)
    try:
        bg = create(server.http, background=True, max_output_tokens=1500)
        stream = Stream(server.url, max_output_tokens=1500)
        stream.start()
        assert stream.started.wait(120) and stream.events
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: server.http.get("/ready").status_code == 503, "/ready to say 503")
        assert server.http.get("/ready").json() == {"status": "draining"}
        assert server.http.get("/health").status_code == 200
        for path, body in [
            ("/v1/responses", {"model": MODEL, "input": "hi"}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            ),
            ("/v1/completions", {"model": MODEL, "prompt": "x"}),
        ]:
            r = server.http.post(path, json=body)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "server_shutting_down"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert server.http.get(f"/v1/responses/{bg['id']}").status_code == 200  # reads work
        code = server.stop(None)  # the drain ends once both have finished
    finally:
        server.stop()
    stream.join(60)
    assert code == 0
    assert stream.events[-1]["type"] == "response.incomplete"
    assert stream.events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    rows = saved(server.store)
    for rid in (bg["id"], stream.id):  # both ran to their max_output_tokens
        assert rows[rid]["status"] == "incomplete"
        assert rows[rid]["incomplete_details"] == {"reason": "max_output_tokens"}
        assert rows[rid]["usage"]["output_tokens"] == 1500
    assert sorted(r[1] for r in ledger(server.accounts)) == ["length", "length"]


def test_sigterm_past_the_graceful_period_keeps_and_bills_what_runs(long_llama, tmp_path):
    server = Serve(long_llama, tmp_path, graceful_s=1)
    stream = Stream(server.url)
    try:
        bg = create(server.http, background=True)
        stream.start()
        assert stream.started.wait(120) and stream.events
        code = server.stop(signal.SIGTERM)
    finally:
        server.stop()
    stream.join(60)
    assert code == 0
    last = stream.events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "server_shutdown"}
    rows = saved(server.store)
    billed = {r[0]: r for r in ledger(server.accounts)}
    for rid in (bg["id"], stream.id):
        r = rows[rid]
        assert r["status"] == "incomplete" and r["error"]["code"] == "server_shutdown"
        assert text_of(r) and 0 < r["usage"]["output_tokens"] < LONG["max_output_tokens"]
        assert billed[rid][1] == "interrupted"
        assert billed[rid][3] == r["usage"]["output_tokens"]
    assert text_of(rows[stream.id]) == stream.text
