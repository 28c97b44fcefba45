"""Deploy a cluster file on Ray Serve: one deployment per pool, one ingress in front.

`deploy(spec)` connects to the Ray cluster at `RAY_ADDRESS` (or starts a local one), starts
Serve (its HTTP proxy only with `[ingress] http = "serve-proxy"`: by default the ingress
replicas listen on the ingress address themselves) and runs the application `expresslane`; it
returns the ingress URL. Running it again with a changed file updates the deployments in place (Ray
Serve rolls the replicas; a replica being removed gets `DRAIN_SECONDS` to finish its work).

`launch` is the command line's deploy: it checks that the file fits the Ray cluster first
(`capacity.py`), says which pools are up and which wait (and why) while replicas start, and
gives up at a deadline; every failure is one line (`DeployError`), never a traceback.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from expresslane.fleet.access import open_without_consent
from expresslane.fleet.capacity import shortfall
from expresslane.fleet.cluster_file import ClusterSpec, PoolSpec
from expresslane.fleet.ingress import DRAIN_SECONDS, Ingress
from expresslane.fleet.names import APP_NAME, INGRESS, pool_deployment_name
from expresslane.fleet.replica import EngineReplica
from expresslane.fleet.router import PrefixAffinityRouter

log = logging.getLogger("expresslane.fleet")

HEALTH_CHECK_SECONDS = 2.0


def _pool_app(spec: ClusterSpec, pool: PoolSpec):
    scaling = (
        {"autoscaling_config": AutoscalingConfig(**pool.autoscaling_config())}
        if pool.autoscaled
        else {"num_replicas": pool.replicas}
    )
    bundles = pool.placement_bundles()
    if bundles is not None:
        scaling.update(placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK")
    deployment = serve.deployment(EngineReplica).options(
        name=pool_deployment_name(pool.name),
        ray_actor_options={"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus},
        max_ongoing_requests=pool.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={
                "imbalance": spec.ingress.imbalance,
                "pool": pool.name,
                "shared": spec.ingress.replicas > 1,
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


# Serve kills an HTTP proxy that is not ready within 5 s and `serve.start` then fails; a busy
# machine can take longer to import and start one. Serve's controller runs its control loop
# every 0.1 s by default: every 0.5 s it used 11 ms of CPU a second idle against 30 (and the
# GCS it polls 7 against 14), time taken from the node's token path. Serve's processes read
# these when they start. Each replica runs its code, and the ingress its handles' router, on
# the replica's own event loop rather than a thread of its own: the ingress's uvicorn and the
# replicas' methods are async and never block it (the engine steps in its own thread), and
# the two thread hops a request made cost about 1 ms of its latency here (BENCHMARKS.md, "The
# fleet's token path").
SERVE_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


# A local cluster's own Ray settings: each Ray process reports task events every 5 s (not 1 s)
# and collects no Ray metrics (nothing scrapes them: the fleet's own metrics are the ingress's
# /metrics). Idle, task events every 5 s and metrics every 50 s cut Ray's processes from
# 112-144 ms of CPU a second to 90-94; no metrics at all halved the dashboard agent's (30 ms/s
# to 17), which ingested every worker's.
LOCAL_RAY_ENV = {
    "RAY_task_events_report_interval_ms": "5000",
    "RAY_enable_metrics_collection": "0",
}


def connect(num_cpus: float | None = None) -> None:
    """Join the cluster at RAY_ADDRESS, or start a local one (with `num_cpus` logical CPUs:
    replicas may ask for fractions of them, and `LOCAL_RAY_ENV`). Serve's processes get
    `SERVE_ENV` (unless the environment sets those already)."""
    if ray.is_initialized():
        return
    env = {k: os.environ.get(k, v) for k, v in SERVE_ENV.items()}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env})
    else:
        env.update({k: os.environ.get(k, v) for k, v in LOCAL_RAY_ENV.items()})
        os.environ.update(env)  # a local cluster's processes inherit them
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        _trim_local_node()


def _trim_local_node() -> None:
    """Stop what a local cluster started that nothing here uses: Ray's log monitor (it sends
    workers' output to drivers, and `log_to_driver` is off), the autoscaler's monitor (a
    local cluster never scales) and the dashboard's API server (jobs and state queries; the
    fleet deploys through Serve's Python API). Idle they cost 20-30 ms of CPU a second, which
    a busy node's token path pays (BENCHMARKS.md, "The fleet's token path")."""
    node = getattr(ray._private.worker, "_global_node", None)  # the processes ray.init started
    for kill in ("kill_log_monitor", "kill_monitor", "kill_dashboard"):
        try:
            getattr(node, kill)(check_alive=False)
        except Exception:  # noqa: BLE001  (another Ray: keep them)
            log.warning("could not stop Ray's %s", kill.removeprefix("kill_"), exc_info=True)


def deploy(spec: ClusterSpec, num_cpus: float | None = None) -> str:
    from expresslane.demo import demo_model_dir

    connect(num_cpus)
    serve.start(**serve_options(spec))
    model_dir = spec.model or str(demo_model_dir())
    serve.run(build_application(spec, model_dir), name=APP_NAME, route_prefix="/")
    return f"http://{spec.ingress.host}:{spec.ingress.port}"


def serve_options(spec: ClusterSpec) -> dict:
    """`serve.start`'s: Serve's HTTP proxy on the ingress address, or none where the ingress
    replicas serve HTTP themselves."""
    if spec.ingress.http == "direct":
        return {"proxy_location": "Disabled"}
    return {"http_options": {"host": spec.ingress.host, "port": spec.ingress.port}}


class DeployError(RuntimeError):
    """A cluster file that cannot be deployed here, said in one line."""


def launch(
    spec: ClusterSpec, num_cpus: float | None, timeout_s: float, say: Callable[[str], None]
) -> str:
    """`deploy`, checked and watched: raises DeployError."""
    refused = open_without_consent(spec)
    if refused:
        raise DeployError(refused)
    connect(num_cpus)
    problem = shortfall(spec, [n["Resources"] for n in ray.nodes() if n["Alive"]])
    if problem:
        raise DeployError(problem)
    _start_serve(spec, say)
    model_dir = spec.model or _demo_model()
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            serve.run(build_application(spec, model_dir), name=APP_NAME, route_prefix="/")
        except Exception as e:  # noqa: BLE001  (reported as one line)
            failed.append(e)
        done.set()

    threading.Thread(target=run, daemon=True, name="serve-run").start()
    _watch(spec, done, timeout_s, say)
    if failed:
        raise DeployError(f"the deployment failed: {_first_line(failed[0])}")
    return f"http://{spec.ingress.host}:{spec.ingress.port}"


def _start_serve(spec: ClusterSpec, say: Callable[[str], None]) -> None:
    """Serve (and its HTTP proxy, if used); a busy machine may not start the proxy in Ray's
    time: one more try."""
    for attempt in (1, 2):
        try:
            serve.start(**serve_options(spec))
            return
        except Exception as e:  # noqa: BLE001  (Ray raises several kinds here)
            if attempt == 2:
                raise DeployError(f"Ray Serve's HTTP proxy did not start: {_first_line(e)}") from e
            say(f"Ray Serve's HTTP proxy did not start ({_first_line(e)}); trying again")
            serve.shutdown()


def _watch(spec: ClusterSpec, done: threading.Event, timeout_s: float, say) -> None:
    """Say each pool's progress as it changes, and once more when the deployment is done."""
    deadline, last = time.monotonic() + timeout_s, None
    while not done.wait(2.0):
        line = progress(spec)
        if line != last:
            say(line)
            last = line
        if time.monotonic() > deadline:
            serve.shutdown()
            raise DeployError(f"gave up after {timeout_s:g} s waiting for replicas: {line}")
    line = progress(spec)
    if line != last:
        say(line)


def progress(spec: ClusterSpec) -> str:
    """One line: each pool's running replicas of those it starts with, and why it waits."""
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001  (the controller may still be starting)
        app = None
    parts = []
    for name, pool in spec.pools.items():
        want = pool.min_replicas if pool.autoscaled else pool.replicas
        d = app.deployments.get(pool_deployment_name(name)) if app else None
        running = d.replica_states.get("RUNNING", 0) if d else 0
        why = f" ({_first_line(d.message)})" if d and d.message and running < want else ""
        parts.append(f"pool {name}: {running}/{want} running{why}")
    return "; ".join(parts)


def _first_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _demo_model() -> str:
    from expresslane.demo import demo_model_dir

    return str(demo_model_dir())
