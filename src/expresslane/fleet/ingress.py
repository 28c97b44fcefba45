"""The ingress deployment: the same OpenAI API as `expresslane serve` (server/app.py), on a
`FleetEngine` instead of a local engine, with the route of each response in its headers."""

from __future__ import annotations

import asyncio

from ray import serve

from expresslane.fleet.cluster_file import ClusterSpec
from expresslane.fleet.remote_engine import FleetEngine, current_routes
from expresslane.fleet.replica import replica_id

ROUTE_WAIT_SECONDS = 60.0  # how long response headers wait for a replica to take the request


class RouteHeaders:
    """ASGI middleware: `x-expresslane-ingress` on every HTTP response, and
    `x-expresslane-pool` and `x-expresslane-replica` on those that ran on the fleet. The
    headers leave when the first replica has taken the request (a stream's first event may be
    ready before that)."""

    def __init__(self, app, ingress: str):
        self.app = app
        self.ingress = (b"x-expresslane-ingress", ingress.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        routes: list = []
        token = current_routes.set(routes)

        async def send_with_route(message):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), self.ingress]
                if routes:
                    pending = [r.known.wait() for r in routes if not r.known.is_set()]
                    if pending:
                        await asyncio.wait_for(asyncio.gather(*pending), ROUTE_WAIT_SECONDS)
                    for name, values in (
                        ("x-expresslane-pool", [r.pool for r in routes]),
                        ("x-expresslane-replica", [r.replica or "" for r in routes]),
                    ):
                        value = ",".join(dict.fromkeys(v for v in values if v))
                        headers.append((name.encode(), value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_route)
        finally:
            current_routes.reset(token)


@serve.ingress()
class Ingress:
    def __init__(self, spec: ClusterSpec, model_dir: str, **pools):
        self.spec = spec
        self.engine = FleetEngine(spec, pools, model_dir)

    def __serve_build_asgi_app__(self):
        from expresslane.fleet.status import fleet_status
        from expresslane.server.app import create_app
        from expresslane.server.settings import ServerSettings

        settings = ServerSettings(**self.spec.server)
        app = create_app(self.engine, settings)
        app.add_api_route("/fleet/status", lambda: fleet_status(self.engine), methods=["GET"])
        return RouteHeaders(app, replica_id())
