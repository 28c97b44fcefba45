"""The ingress deployment: the same OpenAI API as `expresslane serve` (server/app.py), on a
`FleetEngine` instead of a local engine, with the route of each response in its headers.

By default each ingress replica serves HTTP itself: behind Serve's HTTP proxy every streamed
chunk is one more Ray message between two processes, 4-5× the transport CPU per token of
serving directly (BENCHMARKS.md, "The fleet's token path").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import sys

import ray
import uvicorn
from ray import serve

from expresslane.fleet.access import refuse_open_mode
from expresslane.fleet.cluster_file import ClusterSpec
from expresslane.fleet.remote_engine import FleetEngine, current_routes
from expresslane.fleet.replica import replica_id
from expresslane.server.keys import OPEN_ACCESS_ID
from expresslane.server.sse import SERVER_SEND

ROUTE_WAIT_SECONDS = 60.0  # how long response headers wait for a replica to take the request
DRAIN_SECONDS = 60.0  # streams in flight when an ingress replica stops (deploy.py's too)


class RouteHeaders:
    """ASGI middleware: `x-expresslane-ingress` on every HTTP response, and
    `x-expresslane-pool` and `x-expresslane-replica` on those that ran on the fleet. The
    headers leave when the first replica has taken the request (a stream's first event may be
    ready before that). The replica goes only to operator keys (or to every key with
    `[server] replica_headers = true`): which replica holds whose prefixes is other tenants'
    business."""

    def __init__(self, app, ingress: str, replica_for_all: bool = False):
        self.app = app
        self.ingress = (b"x-expresslane-ingress", ingress.encode())
        self.replica_for_all = replica_for_all

    def _shows_replica(self, scope) -> bool:
        key = scope.get("state", {}).get("api_key")
        if self.replica_for_all:
            return True
        return key is not None and (key.operator or key.id == OPEN_ACCESS_ID)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        routes: list = []
        token = current_routes.set(routes)
        scope.setdefault(SERVER_SEND, send)

        async def send_with_route(message):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), self.ingress]
                if routes:
                    pending = [r.known.wait() for r in routes if not r.known.is_set()]
                    if pending:
                        await asyncio.wait_for(asyncio.gather(*pending), ROUTE_WAIT_SECONDS)
                    named = [("x-expresslane-pool", [r.pool for r in routes])]
                    if self._shows_replica(scope):
                        named.append(("x-expresslane-replica", [r.replica or "" for r in routes]))
                    for name, values in named:
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
    """The OpenAI API in front of the pools. With `[ingress] http = "direct"` it listens on
    the ingress address itself (`DirectHTTP`, started and stopped with the app's lifespan,
    which Serve runs); with "serve-proxy", Serve's HTTP proxy forwards to it."""

    async def __init__(self, spec: ClusterSpec, model_dir: str, **pools):
        from expresslane.fleet.status import StatusRoute
        from expresslane.server.app import create_app
        from expresslane.server.settings import ServerSettings

        # Ray's own threads (gRPC, the core worker's) share this process's GIL with the loop
        # that serves: by default a waiting thread gets it only after 5 ms, a hop's delay
        # (measured: 0.5 ms also lowers the ingress's CPU per token, 0.10-0.11 against 0.12-0.13).
        sys.setswitchinterval(0.0005)
        self.spec = spec
        # Requests go to the pools over Serve's gRPC channel between replicas rather than as
        # Ray actor calls: measured here, 1.8 ms from the call to the replica's method against
        # 2.7-3.2 ms (BENCHMARKS.md, "The fleet's token path").
        pools = {name: handle.options(_by_reference=False) for name, handle in pools.items()}
        self.engine = FleetEngine(spec, pools, model_dir, host=ray.util.get_node_ip_address())
        await self.engine.start()
        settings = ServerSettings(**spec.server)
        app = create_app(self.engine, settings)
        refuse_open_mode(spec, app.state.server.accounts)
        app.add_api_route("/fleet/status", StatusRoute(self.engine).get, methods=["GET"])
        self.served = RouteHeaders(app, replica_id(), settings.replica_headers)
        self.direct: DirectHTTP | None = None
        if spec.ingress.http == "direct":
            app.router.lifespan_context = self._serving_directly(app.router.lifespan_context)
        # What exists now (Ray, the app, the tokenizer) lives as long as the ingress: keep it
        # out of the garbage collector's scans, whose pauses are latency spikes (as in
        # AsyncEngine; in an A/B here, probe p99 15-17 ms against 21 without).
        gc.freeze()

    def __serve_build_asgi_app__(self):
        return self.served

    def _serving_directly(self, lifespan):
        @contextlib.asynccontextmanager
        async def serving(app):
            async with lifespan(app):
                self.direct = await DirectHTTP.start(
                    self.served, self.spec.ingress.host, self.spec.ingress.port
                )
                try:
                    yield
                finally:
                    await self.direct.stop()

        return serving

    def check_health(self) -> None:
        """Serve replaces an ingress replica whose HTTP server stopped."""
        if self.direct is not None and not self.direct.serving:
            raise RuntimeError("the ingress's HTTP server stopped")


class DirectHTTP:
    """uvicorn on the ingress replica's event loop, on a socket it shares with the node's other
    ingress replicas (SO_REUSEPORT)."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task):
        self.server, self.task = server, task

    @classmethod
    async def start(cls, app, host: str, port: int) -> DirectHTTP:
        sock = socket.create_server((host, port), reuse_port=True)
        config = uvicorn.Config(
            app,
            lifespan="off",  # Serve runs the app's lifespan
            log_config=None,
            access_log=False,  # request_log.py writes one line per request
            timeout_graceful_shutdown=DRAIN_SECONDS,
        )
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():  # it could not start: say why
                task.result()
                raise RuntimeError("the ingress's HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return cls(server, task)

    @property
    def serving(self) -> bool:
        return not self.task.done()

    async def stop(self) -> None:
        """Stop listening; streams in flight get `DRAIN_SECONDS` to finish."""
        self.server.should_exit = True
        await self.task
