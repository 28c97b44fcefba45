"""A pool whose replicas are tensor-parallel groups (`tp = 2`): `expresslane cluster` places
each replica's two ranks as one Ray placement group, and the replica answers."""

from __future__ import annotations

import httpx
import pytest

from ..ports import free_port
from .cluster_command import running_cluster

pytest.importorskip("ray")

CLUSTER = """
[ingress]
replicas = 1
num_cpus = 0.25
host = "127.0.0.1"
port = {port}
open = true

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
    with running_cluster(cluster):
        body = {"model": "expresslane-demo", "input": "def add(a, b):", "max_output_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-expresslane-pool"] == "std"
        assert r.json()["usage"]["output_tokens"] == 4
