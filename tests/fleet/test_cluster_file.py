"""The cluster file: what it accepts, what it refuses (one line naming the setting), and the
shipped example. No Ray cluster needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from expresslane.fleet.cluster_file import ClusterFileError, load_cluster, parse_cluster
from expresslane.fleet.remote_engine import _ingress_lanes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"
POOLS = {
    "fast": {"tiers": ["ultrafast"], "region": "eu", "spare_flex": True},
    "std": {"tiers": ["default", "flex"], "region": "us", "replicas": 2},
}


def test_the_example_parses():
    spec = load_cluster(str(EXAMPLE))
    assert set(spec.pools) == {"fast", "std"} and spec.regions == ["eu", "us"]
    assert spec.pools["std"].replicas == 2
    assert [p.name for p in spec.pools_for("flex", spare=True)] == ["fast", "std"]


def test_the_example_builds_a_serve_application():
    pytest.importorskip("ray")
    from ray.serve import Application

    from expresslane.fleet.app import build

    assert isinstance(build({"cluster_file": str(EXAMPLE)}), Application)


def test_pool_engines_serve_only_their_tiers():
    spec = parse_cluster({"pools": POOLS})
    fast = spec.pools["fast"].engine_options()["lanes"]
    assert fast["ultrafast"]["enabled"] and fast["flex"]["enabled"]  # spare_flex
    assert not spec.pools["std"].engine_options()["lanes"]["ultrafast"]["enabled"]


def test_ingress_lanes_hold_every_replica_s_batch():
    spec = parse_cluster({"pools": {**POOLS, "std": {**POOLS["std"], "engine": {"max_batch": 8}}}})
    lanes = _ingress_lanes(spec)
    assert lanes["default"]["max_batch"] == 16  # 2 replicas x 8
    assert lanes["ultrafast"]["max_batch"] == 4  # the lane's own default


@pytest.mark.parametrize(
    "data, words",
    [
        ({"pools": {}}, "no [pools.NAME]"),
        ({"pools": {"a": {"tiers": ["ultrafast"]}}}, "no pool serves the default tier"),
        ({"pools": {"a": {"tiers": ["default"], "replica": 2}}}, "unknown setting(s) ['replica']"),
        ({"pools": {"a": {"tiers": ["gold"]}}}, "tiers must name some of"),
        ({"pools": {"a": {"tiers": ["default"], "replicas": "2"}}}, "replicas = '2'"),
        ({"pools": {"a": {"tiers": ["default"], "min_replicas": 1}}}, "set both"),
        ({"pools": {"a": {"tiers": ["default"], "engine": {"max_bach": 4}}}}, "max_bach"),
        ({"pools": {"a": {"tiers": ["default"]}}, "extra": {}}, "unknown table(s) ['extra']"),
        (
            {"ingress": {"replicas": 2}, "pools": {"a": {"tiers": ["default"]}}},
            "[ingress] replicas = 2 needs [server] database",
        ),
    ],
)
def test_mistakes_are_named(data, words):
    with pytest.raises(ClusterFileError) as e:
        parse_cluster(data)
    assert words in str(e.value)


def test_autoscaling_settings_go_to_ray_serve_and_are_checked():
    pytest.importorskip("ray")
    pool = {"tiers": ["default"], "min_replicas": 1, "max_replicas": 3}
    spec = parse_cluster({"pools": {"std": {**pool, "autoscaling": {"upscale_delay_s": 2}}}})
    assert spec.pools["std"].autoscaling_config() == {
        "upscale_delay_s": 2, "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8.0
    }  # fmt: skip
    for table, says in (
        ({"upscale_delay": 2}, "unknown setting(s) ['upscale_delay'] in [pools.std.autoscaling]"),
        ({"upscale_delay_s": "soon"}, "[pools.std.autoscaling] upscale_delay_s"),
    ):
        with pytest.raises(ClusterFileError, match=re.escape(says)):
            parse_cluster({"pools": {"std": {**pool, "autoscaling": table}}})
    with pytest.raises(ClusterFileError, match="needs min_replicas and max_replicas"):
        parse_cluster(
            {"pools": {"std": {"tiers": ["default"], "autoscaling": {"upscale_delay_s": 1}}}}
        )


def test_a_stream_interval_below_one_is_refused():
    with pytest.raises(ClusterFileError, match=r"\[pools.std\] stream_interval must be at least 1"):
        parse_cluster({"pools": {"std": {"tiers": ["default"], "stream_interval": 0}}})


def test_the_ingress_states_a_promise_given_in_numbers(llama_dir):
    pytest.importorskip("ray")
    from expresslane.fleet.remote_engine import FleetEngine

    lanes = {"ultrafast": {"promise": {"tokens_per_s": 40, "ttft_s": 0.5}}}
    stated = FleetEngine(parse_cluster({"pools": POOLS, "lanes": lanes}), {}, llama_dir)
    assert stated.promises()["ultrafast"].floor_tokens_per_s == 20.0
    auto = FleetEngine(parse_cluster({"pools": POOLS}), {}, llama_dir)
    assert auto.promises() == {}  # each replica measures an "auto" one for itself


def test_a_tensor_parallel_pool_is_a_placement_group_per_replica():
    tp = {"tiers": ["default"], "tp": 2, "num_cpus": 0.5}
    spec = parse_cluster({"pools": {"std": tp}})
    pool = spec.pools["std"]
    assert pool.engine_options()["tensor_parallel_size"] == 2
    assert pool.placement_bundles() == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert parse_cluster({"pools": POOLS}).pools["std"].placement_bundles() is None
    for bad in ({"tp": 0}, {"engine": {"tensor_parallel_size": 2}}):
        with pytest.raises(ClusterFileError, match="tp .at least 1. sets"):
            parse_cluster({"pools": {"std": {**tp, **bad}}})
    pytest.importorskip("ray")
    from expresslane.fleet.deploy import _pool_app

    replica = _pool_app(spec, pool)._bound_deployment._replica_config  # Ray Serve's own record
    assert replica.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert replica.placement_group_strategy == "STRICT_PACK"


def test_an_ingress_without_keys_runs_open_only_where_the_file_says_so(tmp_path, monkeypatch):
    """Checked before deploying (a local Ray cluster: the ingress's accounts file is here)."""
    from expresslane.fleet.access import open_without_consent
    from expresslane.server.keys import KeyStore, Plan, connect

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    accounts = str(tmp_path / "accounts.sqlite")
    closed = parse_cluster({"server": {"accounts_path": accounts}, "pools": POOLS})
    assert "open = true" in open_without_consent(closed)
    allowed = {"server": {"accounts_path": accounts}, "ingress": {"open": True}, "pools": POOLS}
    assert open_without_consent(parse_cluster(allowed)) is None
    with_key = {"server": {"accounts_path": accounts, "api_key": "op"}, "pools": POOLS}
    assert open_without_consent(parse_cluster(with_key)) is None
    KeyStore(connect(accounts)).create("alice", Plan())
    assert open_without_consent(closed) is None
