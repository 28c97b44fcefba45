"""`expresslane cluster` checks a cluster file against the Ray cluster before deploying
(`fleet/capacity.py`): a file that cannot fit ends at once, in one line naming the pool, what
it asks and what there is; the shipped example fits a 2-core machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from expresslane.fleet.capacity import shortfall
from expresslane.fleet.cluster_file import load_cluster, parse_cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"
TWO_CORES = [{"CPU": 2.0, "memory": 1e10}]


def pools(**std) -> dict:
    return {
        "pools": {
            "fast": {"tiers": ["ultrafast"], "num_cpus": 0.5},
            "std": {"tiers": ["default"], "replicas": 2, "num_cpus": 0.5, **std},
        }
    }


def test_the_example_fits_two_cores():
    assert shortfall(load_cluster(str(EXAMPLE)), TWO_CORES) is None


def test_too_many_cpus_names_the_total_and_each_ask():
    why = shortfall(parse_cluster(pools(replicas=4, num_cpus=4)), TWO_CORES)
    assert why.startswith("pool 'std' asks 4 CPU per replica, and no Ray node has that much")
    why = shortfall(parse_cluster(pools(replicas=8, num_cpus=1)), TWO_CORES)
    assert "asks 9 CPUs" in why and "pool 'std' 8 x 1" in why and "has 2" in why


def test_gpus_asked_of_a_cluster_without_them():
    why = shortfall(parse_cluster(pools(num_gpus=1)), TWO_CORES)
    assert "pool 'std' asks 0.5 CPU and 1 GPU per replica" in why
    assert shortfall(parse_cluster(pools(num_gpus=1)), [{"CPU": 2.0, "GPU": 2.0}]) is None
    why = shortfall(parse_cluster(pools(num_gpus=1, replicas=3)), [{"CPU": 4.0, "GPU": 2.0}])
    assert "asks 3 GPUs" in why


def test_autoscaled_pools_count_their_minimum():
    spec = parse_cluster(pools(min_replicas=1, max_replicas=8, num_cpus=1))
    assert shortfall(spec, TWO_CORES) is None


def test_a_file_that_cannot_fit_exits_2_in_one_line(tmp_path):
    pytest.importorskip("ray")
    big = tmp_path / "big.toml"
    big.write_text(
        '[ingress]\nopen = true\n[pools.big]\ntiers = ["default"]\nreplicas = 4\nnum_cpus = 4\n'
    )
    cmd = [sys.executable, "-m", "expresslane.cli", "cluster", str(big), "--num-cpus", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "expresslane cluster: error:" in line]
    assert len(lines) == 1 and "pool 'big' asks 4 CPU per replica" in lines[0]
    assert "Traceback" not in out.stderr


def test_a_tensor_parallel_replica_needs_its_ranks_on_one_node():
    why = shortfall(parse_cluster(pools(replicas=1, num_cpus=1.5, tp=2)), TWO_CORES)
    assert why.startswith("pool 'std' asks 3 CPU per replica")
    spec = parse_cluster(pools(replicas=1, num_cpus=0.5, tp=2))
    assert shortfall(spec, [{"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}]) is not None
    assert shortfall(spec, TWO_CORES) is None
