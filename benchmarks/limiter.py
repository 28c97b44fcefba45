"""Rate limits across ingress replicas: buckets in PostgreSQL against buckets in one Ray actor.

Two processes stand for two ingress replicas; each runs `--threads` threads that take from the
requests-per-minute buckets of `--keys` keys (random key per take, limit `--rpm` each) as fast
as they can, for `--seconds`. The same run is made against each place the buckets can live:

  postgres  `SharedRateLimiter`: one upsert per take on a PostgreSQL server started here
            (fsync on: a durable server, as in production)
  ray       the in-process `RateLimiter` inside one named Ray actor, one call per take

Reported per backend: takes/s over both processes, a take's latency (p50, p99), the most any
key was granted against what its limit allows in the run (burst + refill: at most 1.00 means
the limit held), then the same after the bucket holder is restarted halfway through a second
run (PostgreSQL crashed and started again; the actor killed and restarted by Ray): takes that
failed, and how far grants went over the limit (a restarted actor has lost its buckets).

    python benchmarks/limiter.py [--threads 4] [--keys 20] [--rpm 120] [--seconds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from common import machine, save_results  # noqa: E402


def open_limiter(backend: str, target: str):
    """This process's limiter: a `take(key, tier, rpm, tpm, tokens)` callable."""
    if backend == "postgres":
        from expresslane.server.database import connect
        from expresslane.server.shared_limits import SharedRateLimiter

        return SharedRateLimiter(connect(target)).take
    import ray

    address, name = target.split("|")
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    actor = ray.get_actor(name, namespace="bench")
    return lambda *a: ray.get(actor.take.remote(*a))


def ingress(backend: str, target: str, args, start: float, out) -> None:
    """One ingress replica: threads taking until the run's end; (grants, latencies, errors)."""
    take = open_limiter(backend, target)
    granted: Counter = Counter()
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.time() < start:
            time.sleep(0.001)
        while time.time() < start + args.seconds:
            key = f"key-{rng.randrange(args.keys)}"
            t0 = time.perf_counter()
            try:
                ok = take(key, "default", args.rpm, None, 0).allowed
            except Exception:  # noqa: BLE001  (a failed take is what the restart run counts)
                with lock:
                    errors[0] += 1
                time.sleep(0.01)
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
                granted[key] += ok

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((dict(granted), latencies, errors[0]))


def run(backend: str, target: str, args, crash=None) -> dict:
    """Both ingress processes against `backend`; `crash()` is called halfway if given."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = time.time() + 8.0  # both processes connected before the clock starts
    procs = [
        ctx.Process(target=ingress, args=(backend, target, args, start, out)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    if crash is not None:
        time.sleep(max(0.0, start + args.seconds / 2 - time.time()))
        crash()
    parts = [out.get() for _ in procs]
    for p in procs:
        p.join()
    granted: Counter = Counter()
    latencies: list[float] = []
    for g, lat, _ in parts:
        granted.update(g)
        latencies += lat
    allowed = args.rpm + args.rpm * args.seconds / 60  # a full bucket, then the refill
    latencies.sort()
    return {
        "takes_per_s": len(latencies) / args.seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "most_granted_vs_allowed": max(granted.values()) / allowed,
        "failed_takes": sum(e for _, _, e in parts),
    }


def postgres_backend(args) -> dict:
    from tests.postgres import Cluster, _binaries

    cluster = Cluster(_binaries(), durable=True)
    cluster.start()
    try:
        steady = run("postgres", cluster.url, args)
        _clear_postgres(cluster.url)
        crashed = run("postgres", cluster.url, args, crash=cluster.restart)
    finally:
        cluster.stop()
    return {"steady": steady, "restart": crashed}


def _clear_postgres(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        db.execute("DELETE FROM rate_limits")


def ray_backend(args) -> dict:
    import ray

    from expresslane.server.ratelimit import RateLimiter

    ray.init(num_cpus=2, namespace="bench", logging_level="ERROR", log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    holder = ray.remote(max_restarts=-1)(RateLimiter)

    def holder_named(name: str):
        actor = holder.options(name=name, lifetime="detached", num_cpus=0).remote()
        ray.get(actor.take.remote("warm", "default", 1, None, 0))
        return actor

    try:
        holder_named("steady")
        steady = run("ray", address + "|steady", args)
        actor = holder_named("restart")
        crash = lambda: ray.kill(actor, no_restart=False)  # noqa: E731  (Ray restarts it)
        crashed = run("ray", address + "|restart", args, crash=crash)
    finally:
        ray.shutdown()
    return {"steady": steady, "restart": crashed}


def report(name: str, r: dict) -> None:
    s, c = r["steady"], r["restart"]
    print(
        f"{name:8} {s['takes_per_s']:7.0f} takes/s  p50 {s['p50_ms']:.2f} ms  p99 "
        f"{s['p99_ms']:.2f} ms  most granted {s['most_granted_vs_allowed']:.2f} of allowed | "
        f"restart: {c['failed_takes']} failed takes, most granted "
        f"{c['most_granted_vs_allowed']:.2f} of allowed",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4, help="per ingress process")
    ap.add_argument("--keys", type=int, default=20)
    ap.add_argument("--rpm", type=int, default=120)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    results = {"machine": machine(), "settings": vars(args)}
    for name, backend in (("postgres", postgres_backend), ("ray", ray_backend)):
        results[name] = backend(args)
        report(name, results[name])
    print(f"results: {save_results('limiter', results)}")


if __name__ == "__main__":
    main()
