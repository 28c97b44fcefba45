"""What committing a stored response before acknowledging it costs: creation latency and
throughput of `background: true` Responses, and the latency of plain (not background)
requests, for two source trees of expresslane served alternately in one run (the machine's
speed drifts: compare within a round), on SQLite and on PostgreSQL (a durable throwaway cluster:
fsync on).

    git worktree add /tmp/before <commit before the change>
    python benchmarks/store_commit.py --trees /tmp/before/src,src --rounds 3

Each server runs the tiny random Llama of the tests (the model's time is not what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import make_checkpoint  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tree: str, model: Path, root: Path, database: str | None):
        root.mkdir(parents=True, exist_ok=True)
        config = root / "expresslane.toml"
        text = f'[server]\nstore_path = "{root / "responses.sqlite"}"\n'
        config.write_text(text + (f'database = "{database}"\n' if database else ""))
        self.port = free_port()
        cmd = [sys.executable, "-m", "expresslane.cli", "serve", "--model", str(model)]
        cmd += ["--port", str(self.port), "--config", str(config)]
        cmd += ["--accounts", str(root / "accounts.sqlite"), "--kv-cache-memory-gb", "0.1"]
        env = {**os.environ, "PYTHONPATH": tree}
        self.log = open(root / "serve.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server from {tree} did not start (see {root / 'serve.log'})")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def body(**extra) -> dict:
    return {"model": "llama", "input": "hi", "temperature": 0, **extra}


def latencies(url: str, n: int, **extra) -> list[float]:
    out = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(n):
            t = time.perf_counter()
            r = http.post("/v1/responses", json=body(**extra))
            out.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
    return out


def throughput(url: str, clients: int, seconds: float) -> float:
    """Background creations per second with `clients` creating back to back (answers of 429,
    the lane's queue full of earlier creations, are retried and not counted)."""
    done, stop = [], time.monotonic() + seconds

    def client():
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < stop:
                r = http.post("/v1/responses", json=body(background=True, max_output_tokens=1))
                if r.status_code == 429:  # the lane's queue is full: back off, as clients do
                    time.sleep(0.05)
                    continue
                assert r.status_code == 200, r.text
                done.append(1)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(done) / seconds


def measure(url: str, args) -> dict:
    latencies(url, 5, background=True, max_output_tokens=1)  # warm
    create = latencies(url, args.requests, background=True, max_output_tokens=1)
    plain = latencies(url, args.requests, max_output_tokens=4)
    return {
        "create_p50_ms": 1000 * statistics.median(create),
        "create_p90_ms": 1000 * statistics.quantiles(create, n=10)[-1],
        "plain_p50_ms": 1000 * statistics.median(plain),
        "creates_per_s": throughput(url, args.clients, args.seconds),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trees", required=True, help="comma-separated src folders: BEFORE,AFTER")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--stores", default="sqlite,postgres")
    args = p.parse_args()
    trees = args.trees.split(",")
    work = Path(tempfile.mkdtemp(prefix="store-commit-"))
    model = make_checkpoint(work / "model", "llama")
    results: dict = {}
    for store in args.stores.split(","):
        cluster = None
        if store == "postgres":
            from tests.postgres import Cluster, _binaries

            cluster = Cluster(_binaries(), durable=True)
            cluster.start()
        try:
            for r in range(args.rounds):
                for i, tree in enumerate(trees):
                    db = _new_database(cluster, f"r{r}t{i}") if cluster else None
                    server = Server(tree, model, work / f"{store}-{r}-{i}", db)
                    try:
                        m = measure(server.url, args)
                    finally:
                        server.stop()
                    results.setdefault(store, {}).setdefault(tree, []).append(m)
                    print(store, r, tree, json.dumps({k: round(v, 2) for k, v in m.items()}))
        finally:
            if cluster:
                cluster.stop()
    _report(results, trees)


def _new_database(cluster, name: str) -> str:
    import psycopg

    with psycopg.connect(cluster.url, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    return cluster.url.rsplit("/", 1)[0] + "/" + name


def _report(results: dict, trees: list[str]) -> None:
    print("\n| store | measure | " + " | ".join(trees) + " | after/before |")
    print("|---|---|" + "---|" * (len(trees) + 1))
    for store, by_tree in results.items():
        for key in by_tree[trees[0]][0]:
            meds = [statistics.median(m[key] for m in by_tree[t]) for t in trees]
            cells = " | ".join(f"{v:.2f}" for v in meds)
            print(f"| {store} | {key} | {cells} | {meds[-1] / meds[0]:.2f} |")


if __name__ == "__main__":
    main()
