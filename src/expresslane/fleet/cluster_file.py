"""The cluster file (TOML): the pools of engine replicas a fleet runs, and its ingress.

    [model]
    path = "/models/qwen"          # omit for the bundled demo model
    [ingress]
    replicas = 1
    port = 8000
    http = "direct"                # or "serve-proxy": Ray Serve's HTTP proxy in front
    open = false                   # true: may run without API keys (fleet/access.py)
    [server]                       # ServerSettings, as in `expresslane serve --config`
    database = "postgresql://..."  # shared by every ingress replica (needed for several)
    [pools.fast]
    tiers = ["ultrafast"]
    replicas = 1                   # or min_replicas / max_replicas (Ray Serve autoscaling)
    region = "eu"                  # [pools.fast.autoscaling]: more of Ray Serve's
                                   # AutoscalingConfig (upscale_delay_s, ...)
    num_cpus = 1                   # per tensor-parallel rank
    tp = 1                         # ranks per replica: one engine over tp processes, one node
    [pools.fast.engine]            # EngineConfig fields of this pool's replicas
    max_batch = 4
    [pools.fast.lanes.ultrafast]   # lane settings of this pool's replicas
    target_tokens_per_s = "auto"

Each pool is one Ray Serve deployment; a replica is one `LLMEngine` (with `tp` > 1, a
tensor-parallel group: its ranks' CPUs and GPUs reserved as one placement group on one
node). A pool's replicas serve the tiers it lists (its other lanes stay idle); the ingress
sends each request to a pool of its tier in a region its key allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from expresslane.config import EngineConfig
from expresslane.lanes import LANE_NAMES, build_lanes
from expresslane.server.preflight import check_types

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ClusterFileError(ValueError):
    pass


@dataclass
class PoolSpec:
    name: str
    tiers: list[str]
    region: str = "default"
    replicas: int = 1
    min_replicas: int | None = None  # both set: Ray Serve autoscales between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0  # autoscaling: requests per replica it aims at
    autoscaling: dict = field(default_factory=dict)  # more AutoscalingConfig fields
    max_ongoing_requests: int = 64  # Ray Serve sends a replica no more at once
    num_cpus: float = 1.0  # per tensor-parallel rank
    num_gpus: float = 0.0
    tp: int = 1  # tensor-parallel ranks per replica (the engine's tensor_parallel_size)
    engine: dict = field(default_factory=dict)  # EngineConfig fields
    lanes: dict = field(default_factory=dict)  # [lanes.NAME] tables
    # idle replicas take flex work too (preempted by the engine when their tiers' work comes)
    spare_flex: bool = False
    cpu_affinity: list[int] | None = None  # pin replicas to these cores (one-machine fleets)
    # tokens a replica gathers per stream before sending them to the ingress (the first goes
    # at once): fewer, larger hops for less transport CPU per token (SGLang's stream_interval)
    stream_interval: int = 1

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None and self.max_replicas is not None

    def autoscaling_config(self) -> dict:
        """Ray Serve's AutoscalingConfig fields for this pool (when `autoscaled`)."""
        return {
            **self.autoscaling,
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
        }

    def engine_options(self) -> dict:
        """EngineConfig options of a replica: its lanes are the pool's tiers (the default
        lane always exists in an engine; a pool that does not serve it gets none of it)."""
        lanes = {name: dict(values) for name, values in self.lanes.items()}
        for name in LANE_NAMES:
            if name != "default":
                served = name in self.tiers or (name == "flex" and self.spare_flex)
                lanes.setdefault(name, {}).setdefault("enabled", served)
        parallel = {"tensor_parallel_size": self.tp} if self.tp > 1 else {}
        return {**self.engine, "lanes": lanes, **parallel}

    def placement_bundles(self) -> list[dict[str, float]] | None:
        """One bundle per tensor-parallel rank (the replica's actor takes the first), packed
        on one node: the ranks are the replica's own processes. None for a single rank."""
        if self.tp == 1:
            return None
        bundle = {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}
        return [dict(bundle) for _ in range(self.tp)]


@dataclass
class IngressSpec:
    replicas: int = 1
    num_cpus: float = 0.5
    host: str = "127.0.0.1"
    port: int = 8000
    imbalance: int = 4  # requests of load a replica may carry beyond the least loaded one
    # and still win its cached prefix (fleet/router.py)
    # "direct": each ingress replica serves HTTP on host:port itself (SO_REUSEPORT: the kernel
    # spreads connections over a node's ingress replicas); "serve-proxy": Ray Serve's HTTP proxy
    # listens there and forwards each request, and each streamed chunk, to an ingress replica
    http: str = "direct"
    # true: the ingress may serve without any API key (every tier to anyone who reaches it)
    open: bool = False


HTTP_MODES = ("direct", "serve-proxy")


@dataclass
class ClusterSpec:
    pools: dict[str, PoolSpec]
    model: str | None = None
    ingress: IngressSpec = field(default_factory=IngressSpec)
    server: dict = field(default_factory=dict)  # [server] table (ServerSettings)
    lanes: dict = field(default_factory=dict)  # [lanes.*]: prices and limits at the ingress

    def pools_for(self, tier: str, spare: bool = False) -> list[PoolSpec]:
        """The pools serving the tier; with `spare`, also those lending idle replicas to it."""
        return [
            p
            for p in self.pools.values()
            if tier in p.tiers or (spare and tier == "flex" and p.spare_flex)
        ]

    @property
    def tiers(self) -> list[str]:
        return [t for t in LANE_NAMES if self.pools_for(t, spare=True)]

    @property
    def regions(self) -> list[str]:
        return sorted({p.region for p in self.pools.values()})


def _build(cls, table: dict, where: str, **extra):
    known = {f.name for f in fields(cls)} - set(extra)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ClusterFileError(f"unknown setting(s) {unknown} in {where}; known: {sorted(known)}")
    try:
        check_types(cls, table, where.strip("[]"))
    except ValueError as e:
        raise ClusterFileError(str(e)) from None
    return cls(**table, **extra)


def _pool(name: str, table: dict) -> PoolSpec:
    pool = _build(PoolSpec, dict(table), f"[pools.{name}]", name=name)
    bad = [t for t in pool.tiers if t not in LANE_NAMES]
    if not pool.tiers or bad:
        raise ClusterFileError(f"[pools.{name}] tiers must name some of {list(LANE_NAMES)}")
    if (pool.min_replicas is None) != (pool.max_replicas is None):
        raise ClusterFileError(f"[pools.{name}] set both min_replicas and max_replicas")
    if pool.autoscaled and not 0 <= pool.min_replicas <= pool.max_replicas:
        raise ClusterFileError(f"[pools.{name}] needs 0 <= min_replicas <= max_replicas")
    if pool.autoscaling and not pool.autoscaled:
        raise ClusterFileError(f"[pools.{name}.autoscaling] needs min_replicas and max_replicas")
    if pool.autoscaled:
        _check_autoscaling(pool)
    if pool.replicas < 1:
        raise ClusterFileError(f"[pools.{name}] replicas must be at least 1")
    if pool.stream_interval < 1:
        raise ClusterFileError(f"[pools.{name}] stream_interval must be at least 1")
    if pool.tp < 1 or "tensor_parallel_size" in pool.engine:
        raise ClusterFileError(
            f"[pools.{name}] tp (at least 1) sets the replicas' tensor-parallel size, not "
            "[engine] tensor_parallel_size"
        )
    try:
        options = pool.engine_options()
        check_types(EngineConfig, pool.engine, f"pools.{name}.engine")
        EngineConfig.from_options(None, {k: v for k, v in options.items() if k != "model"})
        build_lanes(options["lanes"])
    except ValueError as e:
        raise ClusterFileError(f"[pools.{name}] {e}") from None
    return pool


def _check_autoscaling(pool: PoolSpec) -> None:
    try:
        from ray.serve.config import AutoscalingConfig
    except ImportError:  # checked by Ray Serve when deployed
        return
    where = f"[pools.{pool.name}.autoscaling]"
    own = {"min_replicas", "max_replicas", "target_ongoing_requests"}  # the pool's settings
    known = set(AutoscalingConfig.model_fields) - own
    unknown = sorted(set(pool.autoscaling) - known)
    if unknown:
        raise ClusterFileError(f"unknown setting(s) {unknown} in {where}; known: {sorted(known)}")
    try:
        AutoscalingConfig(**pool.autoscaling_config())
    except ValueError as e:  # pydantic's: "1 validation error ...\nfield\n  message"
        raise ClusterFileError(f"{where} {' '.join(str(e).splitlines()[1:3])}") from None


def parse_cluster(data: dict, where: str = "cluster file") -> ClusterSpec:
    known = {"model", "ingress", "server", "pools", "lanes"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ClusterFileError(f"unknown table(s) {unknown} in {where}; known: {sorted(known)}")
    pools = {name: _pool(name, table) for name, table in data.get("pools", {}).items()}
    if not pools:
        raise ClusterFileError(f"{where} declares no [pools.NAME]")
    spec = ClusterSpec(
        pools=pools,
        model=data.get("model", {}).get("path"),
        ingress=_build(IngressSpec, dict(data.get("ingress", {})), "[ingress]"),
        server=dict(data.get("server", {})),
        lanes=dict(data.get("lanes", {})),
    )
    if "default" not in spec.tiers:
        raise ClusterFileError(f"{where}: no pool serves the default tier")
    if spec.ingress.http not in HTTP_MODES:
        raise ClusterFileError(f"[ingress] http must be one of {list(HTTP_MODES)}")
    _check_shared_state(spec)
    return spec


def _check_shared_state(spec: ClusterSpec) -> None:
    if spec.ingress.replicas > 1 and not spec.server.get("database"):
        raise ClusterFileError(
            f"[ingress] replicas = {spec.ingress.replicas} needs [server] database = "
            '"postgresql://...": without it each ingress replica opens an accounts file of '
            "its own node (its own keys, ledger and limits)"
        )


def load_cluster(path: str) -> ClusterSpec:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ClusterFileError(f"{path} is not valid TOML: {e}") from None
    return parse_cluster(data, path)
