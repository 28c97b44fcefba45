"""Whether a cluster file fits the Ray cluster it is deployed on, checked before anything is
deployed: Ray would otherwise place what fits and wait, silently, for the rest.

Every replica needs one node with its CPUs and GPUs (all its tensor-parallel ranks');
together, the ingress replicas and each pool's replicas (its `min_replicas` when it
autoscales) need the cluster's total. The answer is
one line naming what asks, what the cluster has and how to make it fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from expresslane.fleet.cluster_file import ClusterSpec


@dataclass(frozen=True)
class Ask:
    what: str  # "the ingress" or "pool 'std'"
    replicas: int
    cpus: float  # each
    gpus: float  # each


def asks(spec: ClusterSpec) -> list[Ask]:
    out = [Ask("the ingress", spec.ingress.replicas, spec.ingress.num_cpus, 0.0)]
    for name, pool in spec.pools.items():
        replicas = pool.min_replicas if pool.autoscaled else pool.replicas
        # a tensor-parallel replica's ranks share one node
        cpus, gpus = pool.num_cpus * pool.tp, pool.num_gpus * pool.tp
        out.append(Ask(f"pool {name!r}", replicas, cpus, gpus))
    return out


def shortfall(spec: ClusterSpec, nodes: list[dict[str, float]]) -> str | None:
    """Why `spec` cannot be placed on `nodes` (each node's resources: {"CPU": 2.0, ...}), or
    None when it fits."""
    needs = asks(spec)
    for ask in needs:
        if not any(_holds(node, ask) for node in nodes):
            biggest = _largest(nodes)
            return (
                f"{ask.what} asks {_each(ask)} per replica, and no Ray node has that much "
                f"(the largest: {biggest}); lower its num_cpus/num_gpus (fractions work)"
            )
    for key, unit, per in (("CPU", "CPUs", "cpus"), ("GPU", "GPUs", "gpus")):
        total = sum(node.get(key, 0.0) for node in nodes)
        need = sum(a.replicas * getattr(a, per) for a in needs)
        if need > total + 1e-9:
            parts = ", ".join(
                f"{a.what} {a.replicas} x {getattr(a, per):g}" for a in needs if getattr(a, per)
            )
            return (
                f"the file asks {need:g} {unit} ({parts}) and the Ray cluster has {total:g}: "
                f"lower num_{per} (fractions work) or replicas, or give Ray more {unit} "
                f"(--num-cpus for a local cluster, or more nodes)"
            )
    return None


def _holds(node: dict[str, float], ask: Ask) -> bool:
    return node.get("CPU", 0.0) + 1e-9 >= ask.cpus and node.get("GPU", 0.0) + 1e-9 >= ask.gpus


def _each(ask: Ask) -> str:
    gpus = f" and {ask.gpus:g} GPU" if ask.gpus else ""
    return f"{ask.cpus:g} CPU{gpus}"


def _largest(nodes: list[dict[str, float]]) -> str:
    node = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
    gpus = f" and {node.get('GPU', 0.0):g} GPU" if node.get("GPU") else ""
    return f"{node.get('CPU', 0.0):g} CPU{gpus}"
