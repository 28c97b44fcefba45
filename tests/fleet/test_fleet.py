"""The fleet on a real local Ray cluster: an ultrafast pool in one region, a default pool of two
replicas in another, one ingress in front; the official openai SDK as the client."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from expresslane.fleet.cluster_file import parse_cluster  # noqa: E402
from expresslane.fleet.deploy import deploy  # noqa: E402
from expresslane.fleet.names import APP_NAME, pool_deployment_name  # noqa: E402
from expresslane.server.database import connect  # noqa: E402
from expresslane.server.keys import KeyStore, Plan  # noqa: E402
from expresslane.server.metering import Ledger  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.postgres import new_database  # noqa: E402

RPM = 6
STD_INTERVAL = 3  # the default pool's replicas send tokens 3 at a time (after the first)

ENGINE = {"calibrate": False, "num_kv_blocks": 256, "seed": 0}
PROMPT = (
    "Read the file `Lib/asyncio/events.py` and tell me which functions it defines, then run "
    "the tests of `Lib/asyncio/events.py` and say which fail."
)


def cluster(port: int, database: str, std_replicas: int = 2, std_scaling: dict | None = None):
    std = {"replicas": std_replicas} if std_scaling is None else std_scaling
    return parse_cluster(
        {
            "ingress": {"port": port, "num_cpus": 0.2, "replicas": 2},
            "server": {"database": database},
            "pools": {
                "fast": {
                    "tiers": ["ultrafast"],
                    "region": "eu",
                    "num_cpus": 0.5,
                    "spare_flex": True,
                    "engine": {**ENGINE, "max_batch": 4},
                },
                "std": {
                    "tiers": ["default", "flex"],
                    "region": "us",
                    "stream_interval": STD_INTERVAL,
                    **std,
                    "num_cpus": 0.5,
                    "engine": ENGINE,
                },
            },
        }
    )


@pytest.fixture(scope="module")
def fleet(postgres_url):
    """The fleet, its two ingress replicas sharing one PostgreSQL database."""
    database = new_database(postgres_url)
    store = KeyStore(connect(database))
    tiers = ["ultrafast", "default", "flex"]
    made = {
        name: store.create(
            name, Plan(tiers=tiers, regions=regions, limits=limits, operator=name == "any")
        )
        for name, regions, limits in (
            ("any", None, {}),  # the operator's: sees replicas and /fleet/status
            ("eu", ["eu"], {}),
            ("us", ["us"], {}),
            ("slow", None, {"default": {"rpm": RPM}}),
        )
    }
    secrets = {name: secret for name, (_, secret) in made.items()}
    ids = {name: key.id for name, (key, _) in made.items()}
    port = free_port()
    url = deploy(cluster(port, database), num_cpus=4)
    try:
        yield {"url": url, "keys": secrets, "ids": ids, "port": port, "database": database}
    finally:
        serve.shutdown()
        ray.shutdown()


def client(fleet, key: str = "any") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=fleet["url"] + "/v1", api_key=fleet["keys"][key], max_retries=0, timeout=120
    )


def chat(c: openai.OpenAI, tier: str, **kwargs):
    return c.chat.completions.with_raw_response.create(
        model="expresslane-demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        service_tier=tier,
        **kwargs,
    )


def long_stream(c: openai.OpenAI, tier: str):
    """A streamed chat that runs for seconds (sampled to near the 2,048-token context)."""
    return c.chat.completions.with_streaming_response.create(
        model="expresslane-demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=1900,
        temperature=1.0,
        stream=True,
        service_tier=tier,
        extra_body={"ignore_eos": True},
    )


def test_tiers_land_on_their_pools(fleet):
    c = client(fleet)
    # flex first goes to the ultrafast pool's idle replica
    for tier, pool in (("default", "std"), ("ultrafast", "fast"), ("flex", "fast")):
        r = chat(c, tier)
        assert r.headers["x-expresslane-pool"] == pool
        assert r.headers["x-expresslane-replica"]
        assert r.parse().service_tier == tier
        assert r.parse().usage.completion_tokens > 0


def test_tenants_see_neither_replicas_nor_fleet_status(fleet):
    r = chat(client(fleet, "us"), "default")
    assert r.headers["x-expresslane-pool"] == "std" and "x-expresslane-replica" not in r.headers
    url = fleet["url"] + "/fleet/status"
    assert httpx.get(url, timeout=30).status_code == 401
    tenant = {"authorization": f"Bearer {fleet['keys']['us']}"}
    refused = httpx.get(url, headers=tenant, timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "operator_key_required"


def test_flex_leaves_a_busy_ultrafast_pool_alone(fleet):
    c = client(fleet)
    with long_stream(c, "ultrafast") as running:
        assert running.headers["x-expresslane-pool"] == "fast"
        lines = running.iter_lines()  # kept: dropping it would close the stream
        next(lines)
        # whichever ingress replica takes it, the busy ultrafast replica turns flex away
        assert chat(c, "flex").headers["x-expresslane-pool"] == "std"
    # once the stream's abort landed, the idle ultrafast replica takes flex again
    _wait(lambda: chat(c, "flex").headers["x-expresslane-pool"] == "fast", 30)


def test_a_client_leaving_mid_stream_frees_its_replica(fleet):
    """A client leaving mid-stream leaves nothing running or holding KV blocks in the replica
    (its disconnect cancels the ingress's Serve call, which aborts the request there), and the
    ledger bills what was sent, once, as an abort."""
    with long_stream(client(fleet), "ultrafast") as running:
        lines = running.iter_lines()
        first = next(line for line in lines if '"content"' in line)
    completion_id = json.loads(first.removeprefix("data: "))["id"]
    fast = serve.get_deployment_handle(pool_deployment_name("fast"), APP_NAME)
    idle = {"running": 0, "waiting": 0, "kv_used_blocks": 0}
    _wait(lambda: fast.record_routing_stats.remote().result() == idle, 60)
    ledger = Ledger(connect(fleet["database"]))
    _wait(lambda: ledger.rows(completion_id), 60)
    [row] = ledger.rows(completion_id)
    assert row["status"] == "abort" and 0 < row["output_tokens"] < 1900


def test_a_client_leaving_before_its_first_token_has_it_aborted_and_billed(fleet):
    """A stream's response starts once a replica took the request (its first output): a
    client that leaves before has the request aborted there, and billed as an abort (it was
    left running for nobody, and never billed). The fast pool's batch is full, so the request
    waits in its replica until the client has gone."""
    fast = serve.get_deployment_handle(pool_deployment_name("fast"), APP_NAME)
    ledger = Ledger(connect(fleet["database"]))
    seen = {row["id"] for row in ledger.rows()}

    def ours() -> list[dict]:
        rows = ledger.rows()
        return [r for r in rows if r["id"] not in seen and r["key_id"] == fleet["ids"]["eu"]]

    with contextlib.ExitStack() as batch:
        streams = [batch.enter_context(long_stream(client(fleet), "ultrafast")) for _ in range(4)]
        lines = [stream.iter_lines() for stream in streams]  # (kept: a dropped one hangs up)
        for stream_lines in lines:  # the fast pool's max_batch, running
            next(stream_lines)
        body = json.dumps(
            {
                "model": "expresslane-demo",
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 50,
                "stream": True,
                "service_tier": "ultrafast",
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {fleet['keys']['eu']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", fleet["port"])) as sock:
            sock.sendall(head.encode() + body)
            _wait(lambda: fast.record_routing_stats.remote().result()["waiting"] == 1, 60)
        _wait(ours, 60)
        [row] = ours()
        assert row["status"] == "abort" and row["output_tokens"] == 0
        assert fast.record_routing_stats.remote().result()["waiting"] == 0


def operator(fleet) -> dict:
    return {"authorization": f"Bearer {fleet['keys']['any']}"}


def _status(fleet) -> dict:
    pools = httpx.get(fleet["url"] + "/fleet/status", headers=operator(fleet), timeout=30)
    pools = pools.json()["pools"]
    return {p["name"]: p for p in pools}


def test_a_pool_streams_its_tokens_in_intervals(fleet):
    stream = client(fleet).chat.completions.create(
        model="expresslane-demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=13,
        stream=True,
        stream_options={"include_usage": True},
        service_tier="default",
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].usage.completion_tokens == 13
    assert 1 < len(texts) <= 1 + math.ceil(12 / STD_INTERVAL)  # the first token, then 3s


def test_a_key_limited_to_a_region_never_leaves_it(fleet):
    eu, us = client(fleet, "eu"), client(fleet, "us")
    assert chat(eu, "ultrafast").headers["x-expresslane-pool"] == "fast"
    assert chat(us, "default").headers["x-expresslane-pool"] == "std"
    for c, tier in ((eu, "default"), (us, "ultrafast")):
        with pytest.raises(openai.PermissionDeniedError) as e:
            chat(c, tier)
        assert e.value.code == "region_not_allowed"


def _both_ingresses_up(fleet) -> None:
    """Until both ingress replicas have answered (one may still be starting; the proxy sends
    every request to the other meanwhile), at most a minute."""
    seen, deadline = set(), time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        seen.add(httpx.get(fleet["url"] + "/health").headers["x-expresslane-ingress"])
    assert len(seen) == 2


def test_two_ingress_replicas_share_limits_and_ledger(fleet):
    _both_ingresses_up(fleet)
    ok, limited, ingresses, usage = 0, 0, set(), 0
    for _ in range(3 * RPM):
        try:  # a client per request: the kernel spreads connections over the ingresses
            r = chat(client(fleet, "slow"), "default")
        except openai.RateLimitError as e:
            limited += 1
            ingresses.add(e.response.headers["x-expresslane-ingress"])
            continue
        ok += 1
        ingresses.add(r.headers["x-expresslane-ingress"])
        usage += r.parse().usage.total_tokens
    assert len(ingresses) == 2  # both ingress replicas answered
    assert RPM <= ok <= RPM + 1 and limited == 3 * RPM - ok  # one bucket, within a refill
    rows = [
        u for u in Ledger(connect(fleet["database"])).usage() if u["key_id"] == fleet["ids"]["slow"]
    ]
    assert sum(u["input_tokens"] + u["output_tokens"] for u in rows) == usage


def test_a_previous_response_chain_returns_to_its_replica(fleet):
    c = client(fleet)
    homes = set()
    for i in range(4):
        first = c.responses.with_raw_response.create(
            model="expresslane-demo",
            input=f"Task {i}. {PROMPT}",
            max_output_tokens=8,
            temperature=0,
        )
        home = first.headers["x-expresslane-replica"]
        homes.add(home)
        then = c.responses.with_raw_response.create(
            model="expresslane-demo",
            input="Now list `Lib/asyncio`.",
            previous_response_id=first.parse().id,
            max_output_tokens=8,
            temperature=0,
        )
        assert then.headers["x-expresslane-replica"] == home
        assert then.parse().usage.input_tokens_details.cached_tokens > 0


def test_streams_metrics_and_status(fleet):
    c = client(fleet)
    with c.chat.completions.with_streaming_response.create(
        model="expresslane-demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        stream=True,
        service_tier="ultrafast",
    ) as r:
        assert r.headers["x-expresslane-pool"] == "fast"
        assert "[DONE]" in r.read().decode()
    # Each ingress replica counts what it routed, and a new connection may reach either: ask
    # both pools through fresh connections until the replica answering /metrics has routed both.
    for _ in range(20):
        for tier in ("ultrafast", "default"):
            assert chat(client(fleet), tier).headers["x-expresslane-pool"]
        metrics = httpx.get(fleet["url"] + "/metrics", timeout=30).text
        if 'pool="fast"' in metrics and 'pool="std"' in metrics:
            break
    assert 'pool="fast"' in metrics and 'pool="std"' in metrics
    out = subprocess.run(
        [sys.executable, "-m", "expresslane.cli", "cluster", "status", "--url", fleet["url"]]
        + ["--api-key", fleet["keys"]["any"]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr
    assert "fast" in out.stdout and "std" in out.stdout and "eu" in out.stdout
    status = httpx.get(fleet["url"] + "/fleet/status", headers=operator(fleet), timeout=30).json()
    loads = {p["name"]: p["load"] for p in status["pools"]}
    assert len(loads["std"]) == 2 and len(loads["fast"]) == 1  # every replica reports
    assert all(set(v) == {"running", "waiting", "kv_used_blocks"} for v in loads["std"].values())
    assert "KV blocks" in out.stdout


def _replicas(pool: str) -> list[str]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#{pool_deployment_name(pool)}#"
    names = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in names if a["name"].startswith(prefix)]


def _running(pool: str) -> int:
    d = serve.status().applications[APP_NAME].deployments[pool_deployment_name(pool)]
    return d.replica_states.get("RUNNING", 0)


def _wait(condition, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(1.0)


def _kill_mid_stream(c) -> tuple[str, str, str]:
    """Kill the replica serving a long stream; (victim, completion id, what the client got)."""
    actors = {name: ray.get_actor(name, namespace="serve") for name in _replicas("std")}
    with long_stream(c, "default") as running:
        home = running.headers["x-expresslane-replica"]
        victim = next(name for name in actors if name.endswith("#" + home))
        lines = running.iter_lines()
        first = next(line for line in lines if '"content"' in line)  # started answering
        ray.kill(actors[victim], no_restart=True)  # (killed before, it would be retried)
        rest = list(lines)
    return victim, json.loads(first.removeprefix("data: "))["id"], "\n".join(rest)


def test_a_killed_replica_is_replaced_and_the_pool_keeps_answering(fleet):
    c = client(fleet)
    for _ in range(3):  # a stream may still finish before the kill lands: then kill again
        victim, completion_id, rest = _kill_mid_stream(c)
        _wait(lambda v=victim: v not in _replicas("std") and _running("std") == 2)
        if '"finish_reason": "length"' not in rest:
            break
    else:
        pytest.skip("each stream finished before the kill landed (replaced replicas checked)")
    assert "the replica serving this request failed" in rest  # the started stream says so
    for _ in range(6):  # the pool answers meanwhile (requests routed to the dead one retry)
        r = chat(c, "default")
        assert r.headers["x-expresslane-pool"] == "std"
    assert chat(c, "default").parse().usage.completion_tokens > 0
    ledger = Ledger(connect(fleet["database"])).rows()
    assert len([r for r in ledger if r["request_id"].startswith(completion_id)]) == 1  # once


def _stream_default(c, max_tokens: int, results: list, errors: list) -> None:
    """One streamed default-tier chat: its finish reason into `results`, or its error."""
    try:
        s = c.chat.completions.create(
            model="expresslane-demo",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=max_tokens,
            stream=True,
            service_tier="default",
            extra_body={"ignore_eos": True},
        )
        results.append([ch.choices[0].finish_reason for ch in s if ch.choices][-1])
    except Exception as e:  # noqa: BLE001  (any failure is what these tests look for)
        errors.append(repr(e))


def test_scale_down_drains_without_errors(fleet):
    c = client(fleet)
    results, errors = [], []

    def stream():
        _stream_default(c, 48, results, errors)

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    deploy(cluster(fleet["port"], fleet["database"], std_replicas=1))
    for t in threads:
        t.join(300)
    assert errors == [] and results == ["length"] * 6
    _wait(lambda: _running("std") == 1 and len(_replicas("std")) == 1)


def test_autoscaling_adds_a_replica_under_load_and_drains_it_after(fleet):
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1}
    scaling["autoscaling"] = {"upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
                              "look_back_period_s": 2.0, "metrics_interval_s": 0.5}  # fmt: skip
    deploy(cluster(fleet["port"], fleet["database"], std_scaling=scaling))
    _wait(lambda: _running("std") == 1)
    c = client(fleet)
    loaded, results, errors = threading.Event(), [], []

    def streams():
        while not loaded.is_set():  # keep 3 requests on the pool until it has grown
            _stream_default(c, 200, results, errors)

    threads = [threading.Thread(target=streams) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: _running("std") == 2)
    finally:
        loaded.set()
        for t in threads:
            t.join(300)
    _wait(lambda: _running("std") == 1 and len(_replicas("std")) == 1)  # idle: back to min
    assert errors == [] and results and set(results) == {"length"}
    assert chat(c, "default").headers["x-expresslane-pool"] == "std"


def test_the_local_cluster_runs_no_monitor_or_dashboard(fleet):
    """deploy() stops the three processes of a local cluster nothing uses (their idle CPU is
    taken from the token path's core)."""
    session = ray._private.worker._global_node.get_session_dir_path()
    ours = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if session in cmd:
            ours.append(cmd)
    assert any("gcs_server" in cmd for cmd in ours)  # the session's processes are found
    unused = ("log_monitor.py", "/monitor.py", "/dashboard.py")
    assert not [cmd for cmd in ours if any(name in cmd for name in unused)]


def test_bench_reports_pools(fleet, tmp_path):
    from expresslane.cli import main

    for tier, pool in (("ultrafast", "fast"), ("default", "std")):
        out = tmp_path / tier
        args = ["bench", "--base-url", fleet["url"], "--api-key", fleet["keys"]["any"]]
        args += ["--tier", tier, "--requests", "3", "--concurrency", "1", "--out", str(out)]
        args += ["--input-tokens", "12", "--output-tokens", "4", "--quiet", "--seed", "7"]
        assert main(args) == 0
        summary = json.loads((out / "results.json").read_text())["runs"][0]["summary"]
        assert list(summary["pools"]) == [f"{pool}/{tier}"]
        assert summary["pools"][f"{pool}/{tier}"]["requests"] == 3
        assert f"{pool}/{tier}" in (out / "report.md").read_text()


def test_websocket_mode_through_the_ingress(fleet):
    c = client(fleet)
    with c.responses.connect() as conn:
        for tier in ("ultrafast", "default"):
            conn.response.create(
                model="expresslane-demo",
                input=PROMPT,
                max_output_tokens=4,
                temperature=0,
                service_tier=tier,
                store=False,
            )
            for event in conn:
                if event.type in ("response.completed", "response.incomplete", "error"):
                    break
            assert event.type in ("response.completed", "response.incomplete"), event
            assert event.response.service_tier == tier
            assert event.response.usage.output_tokens > 0
