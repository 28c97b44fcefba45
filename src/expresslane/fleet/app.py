"""`build`: the fleet as a Ray Serve application builder, for a Serve config file or KubeRay's
`RayService` (`import_path: expresslane.fleet.app:build`, `args: {cluster_file: PATH}`).
The ingress replicas listen on the cluster file's `[ingress]` address themselves (unless it says
`http = "serve-proxy"`: then Serve's own `http_options` say where its proxy listens)."""

from __future__ import annotations

from expresslane.fleet.cluster_file import load_cluster
from expresslane.fleet.deploy import build_application


def build(args: dict):
    from expresslane.demo import demo_model_dir

    spec = load_cluster(args["cluster_file"])
    return build_application(spec, spec.model or str(demo_model_dir()))
