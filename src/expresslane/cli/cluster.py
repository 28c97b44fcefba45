"""`expresslane cluster FILE.toml` and `expresslane cluster status`: a fleet on Ray Serve."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading

from expresslane.cli.arg_types import fail, positive_float

PROG = "expresslane cluster"


def add_cluster_command(sub) -> None:
    c = sub.add_parser(
        "cluster",
        help="deploy a cluster file on Ray Serve (RAY_ADDRESS, or a local Ray), or show status",
        description="`expresslane cluster FILE.toml` deploys the pools and the ingress of the "
        "file on the Ray cluster at RAY_ADDRESS (or on a local one it starts), prints the "
        "ingress URL and serves until interrupted. `expresslane cluster status` shows pools, "
        "replicas, load and regions. Needs the `fleet` extra (ray[serve]).",
    )
    c.add_argument("target", metavar="FILE.toml|status", help="a cluster file, or `status`")
    c.add_argument(
        "--url",
        default=None,
        help="status: the ingress URL (default: http://127.0.0.1:8000)",
    )
    c.add_argument(
        "--api-key",
        default=None,
        help="status: an operator key (the ingress's api_key, or a key with an operator plan; "
        "default: $EXPRESSLANE_API_KEY)",
    )
    c.add_argument(
        "--num-cpus",
        type=positive_float,
        default=None,
        help="a local Ray cluster's logical CPUs (replicas may ask for fractions of them)",
    )
    c.add_argument(
        "--start-timeout",
        type=positive_float,
        default=600.0,
        help="give up when the replicas are not all running after this many seconds (600)",
    )
    c.add_argument("--json", action="store_true", help="status: print the JSON")
    c.set_defaults(func=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        return fail(PROG, "Ray Serve is not installed: pip install 'expresslane[fleet]'")
    if args.target == "status":
        return _status(args)
    from expresslane.fleet.cluster_file import ClusterFileError, load_cluster

    try:
        spec = load_cluster(args.target)
    except (OSError, ClusterFileError) as e:
        return fail(PROG, str(e))
    from expresslane.fleet.deploy import DeployError, launch

    def say(line: str) -> None:
        print(f"expresslane fleet: {line}", flush=True)

    try:
        url = launch(spec, args.num_cpus, args.start_timeout, say)
    except DeployError as e:
        return fail(PROG, str(e))
    print(f"expresslane fleet: ingress at {url} (pools: {', '.join(spec.pools)})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    return 0


def _status(args: argparse.Namespace) -> int:
    import httpx

    from expresslane.fleet.status import render

    url = (args.url or "http://127.0.0.1:8000").rstrip("/")
    key = args.api_key or os.environ.get("EXPRESSLANE_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(url + "/fleet/status", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        return fail(PROG, f"no fleet ingress answers at {url}: {e}")
    if r.status_code in (401, 403):
        return fail(PROG, f"{url} refused: {r.json()['error']['message']} (--api-key)")
    if r.status_code != 200:
        return fail(PROG, f"{url}/fleet/status answered {r.status_code}: {r.text[:200]}")
    print(json.dumps(r.json(), indent=2) if args.json else render(r.json()))
    return 0
