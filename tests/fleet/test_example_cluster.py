"""The shipped cluster file, started as a newcomer starts it (`expresslane cluster
examples/cluster.toml`, a local Ray cluster of this machine's cores): it says how its pools
come up, prints the ingress URL, and each tier is answered by its own pool, with the ingress
serving HTTP itself or behind Ray Serve's proxy."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ..ports import free_port
from .cluster_command import running_cluster

pytest.importorskip("ray")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"


@pytest.mark.parametrize("http", ["direct", "serve-proxy"])
def test_the_example_starts_and_serves_each_tier_from_its_pool(tmp_path, http):
    port = free_port()
    cluster = tmp_path / "cluster.toml"
    ingress = f'port = {port}\nhttp = "{http}"'
    cluster.write_text(EXAMPLE.read_text().replace("port = 8000", ingress))
    with running_cluster(cluster) as lines:
        said = "".join(lines)  # Ray's own lines may land between (or inside) the CLI's
        assert "pool fast:" in said and "pool std:" in said, said[-3000:]
        url = f"http://127.0.0.1:{port}/v1/responses"
        pools = {}
        for tier in ("ultrafast", "default"):
            body = {"input": "def add(a, b):", "max_output_tokens": 4, "service_tier": tier}
            r = httpx.post(url, json={**body, "model": "expresslane-demo"}, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["service_tier"] == tier
            pools[tier] = r.headers["x-expresslane-pool"]
        assert pools == {"ultrafast": "fast", "default": "std"}
