"""A pool whose replicas are tensor-parallel groups (`tp = 2`): `expresslane cluster` places
each replica's two ranks as one Ray placement group, and the replica answers."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import httpx
import pytest

from .test_example_cluster import free_port

pytest.importorskip("ray")

CLUSTER = """
[ingress]
replicas = 1
num_cpus = 0.25
host = "127.0.0.1"
port = {port}

[pools.std]
tiers = ["default", "flex"]
replicas = 1
num_cpus = 0.5
tp = 2

[pools.std.engine]
max_batch = 8
calibrate = false
"""


def test_a_tensor_parallel_replica_serves(tmp_path):
    port = free_port()
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CLUSTER.format(port=port))
    cmd = [sys.executable, "-m", "expresslane.cli", "cluster", str(cluster)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "ingress at http://" in line:
                up.set()
        up.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert up.wait(900) and proc.poll() is None, "".join(lines[-40:])
        body = {"model": "expresslane-demo", "input": "def add(a, b):", "max_output_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-expresslane-pool"] == "std"
        assert r.json()["usage"]["output_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
