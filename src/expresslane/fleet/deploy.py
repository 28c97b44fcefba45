"""Deploy a cluster file on Ray Serve: one deployment per pool, one ingress in front.

`deploy(spec)` connects to the Ray cluster at `RAY_ADDRESS` (or starts a local one), starts
Serve's HTTP proxy on the ingress address and runs the application `expresslane`; it returns
the ingress URL. Running it again with a changed file updates the deployments in place (Ray
Serve rolls the replicas; a replica being removed gets `DRAIN_SECONDS` to finish its work).
"""

from __future__ import annotations

import os

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from expresslane.fleet.cluster_file import ClusterSpec, PoolSpec
from expresslane.fleet.ingress import Ingress
from expresslane.fleet.names import APP_NAME, INGRESS, pool_deployment_name
from expresslane.fleet.replica import EngineReplica
from expresslane.fleet.router import PrefixAffinityRouter

DRAIN_SECONDS = 60.0
HEALTH_CHECK_SECONDS = 2.0


def _pool_app(spec: ClusterSpec, pool: PoolSpec):
    scaling = (
        {"autoscaling_config": AutoscalingConfig(**pool.autoscaling_config())}
        if pool.autoscaled
        else {"num_replicas": pool.replicas}
    )
    deployment = serve.deployment(EngineReplica).options(
        name=pool_deployment_name(pool.name),
        ray_actor_options={"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus},
        max_ongoing_requests=pool.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={
                "imbalance": spec.ingress.imbalance,
                "index_name": f"expresslane-prefixes-{pool.name}",
            },
        ),
        health_check_period_s=HEALTH_CHECK_SECONDS,
        graceful_shutdown_timeout_s=DRAIN_SECONDS,
        **scaling,
    )
    threads = max(1, round(pool.num_cpus))
    return deployment.bind(
        pool=pool.name,
        tiers=pool.tiers,
        model=spec.model,
        options=pool.engine_options(),
        threads=threads,
        cpu_affinity=pool.cpu_affinity,
        stream_interval=pool.stream_interval,
    )


def build_application(spec: ClusterSpec, model_dir: str):
    ingress = serve.deployment(Ingress).options(
        name=INGRESS,
        num_replicas=spec.ingress.replicas,
        ray_actor_options={"num_cpus": spec.ingress.num_cpus},
        max_ongoing_requests=10_000,  # the server's own admission control limits work
        graceful_shutdown_timeout_s=DRAIN_SECONDS,
    )
    pools = {name: _pool_app(spec, pool) for name, pool in spec.pools.items()}
    return ingress.bind(spec, model_dir, **pools)


def connect(num_cpus: float | None = None) -> None:
    """Join the cluster at RAY_ADDRESS, or start a local one (with `num_cpus` logical CPUs:
    replicas may ask for fractions of them)."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def deploy(spec: ClusterSpec, num_cpus: float | None = None) -> str:
    from expresslane.demo import demo_model_dir

    connect(num_cpus)
    host, port = spec.ingress.host, spec.ingress.port
    serve.start(http_options={"host": host, "port": port})
    model_dir = spec.model or str(demo_model_dir())
    serve.run(build_application(spec, model_dir), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"
