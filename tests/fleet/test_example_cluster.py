"""The shipped cluster file, started as a newcomer starts it (`expresslane cluster
examples/cluster.toml`, a local Ray cluster of this machine's cores): it says how its pools
come up, prints the ingress URL, and each tier is answered by its own pool."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_example_starts_and_serves_each_tier_from_its_pool(tmp_path):
    port = free_port()
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(EXAMPLE.read_text().replace("port = 8000", f"port = {port}"))
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
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
