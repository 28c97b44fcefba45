"""`GET /fleet/status` on the ingress, and its rendering by `expresslane cluster status`: each
pool's tiers, region and replicas (Ray Serve's view of them), and each replica's load as it
last reported it (requests running and waiting, KV blocks used; fleet/load_board.py).

The route is the operator's (`server/auth.py` `require_operator`: the `api_key` key or an
operator key; anyone in open mode), and each answer serves the hits of the next
`CACHE_SECONDS`: Serve and the records actor are asked at most once per period."""

from __future__ import annotations

import asyncio
import time

import ray
from ray import serve
from starlette.requests import Request

from expresslane.fleet.names import APP_NAME, pool_deployment_name
from expresslane.fleet.records import records
from expresslane.fleet.remote_engine import FleetEngine
from expresslane.server.auth import require_operator
from expresslane.server.state import get_state

CACHE_SECONDS = 2.0


class StatusRoute:
    """`GET /fleet/status`: operator only, cached briefly."""

    def __init__(self, engine: FleetEngine):
        self.engine = engine
        self._lock = asyncio.Lock()
        self._cached: tuple[float, dict] | None = None

    async def get(self, request: Request) -> dict:
        require_operator(request, get_state(request).accounts)
        async with self._lock:  # hits while one is asked wait for its answer
            if self._cached is None or time.monotonic() - self._cached[0] > CACHE_SECONDS:
                status = await asyncio.to_thread(fleet_status, self.engine)
                self._cached = (time.monotonic(), status)
            return self._cached[1]


def fleet_status(engine: FleetEngine) -> dict:
    deployments = serve.status().applications[APP_NAME].deployments
    loads = ray.get(records().pools.remote(), timeout=10)
    pools = []
    for pool in engine.spec.pools.values():
        d = deployments.get(pool_deployment_name(pool.name))
        pools.append(
            {
                "name": pool.name,
                "tiers": pool.tiers,
                "region": pool.region,
                "status": getattr(d.status, "value", str(d.status)) if d else "missing",
                "replica_states": {str(k): v for k, v in d.replica_states.items()} if d else {},
                "load": loads.get(pool.name, {}),
            }
        )
    return {"pools": pools, "regions": engine.spec.regions}


def render(status: dict) -> str:
    lines = [f"{'pool':<14}{'tiers':<24}{'region':<10}{'status':<12}replicas  load"]
    for p in status["pools"]:
        states = ", ".join(f"{n} {s.lower()}" for s, n in p["replica_states"].items()) or "-"
        load = ", ".join(_load(r, n) for r, n in sorted(p["load"].items())) or "-"
        tiers = ",".join(p["tiers"])
        lines.append(
            f"{p['name']:<14}{tiers:<24}{p['region']:<10}{p['status']:<12}{states}  {load}"
        )
    return "\n".join(lines)


def _load(replica: str, load: dict) -> str:
    return (
        f"{replica}: {load['running']} running, {load['waiting']} waiting, "
        f"{load['kv_used_blocks']} KV blocks"
    )
