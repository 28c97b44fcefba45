"""`FleetEngine`: the `ServingEngine` a fleet's ingress gives the server, in front of pools.

The server code is the same as in one process (keys, rate limits, metering, the response
store, every endpoint); only the engine differs. `make_request` validates and tokenizes here
(`RequestFactory`, no weights needed). `enqueue` picks a pool of the request's tier in a region
its key allows (the one with the fewest requests in flight per replica), and Ray Serve's router
for that pool (fleet/router.py) picks the replica; the request's outputs come back through
this ingress's `TokenInbox` (fleet/token_channel.py). A replica that fails before the request
produced a token is replaced by another replica of the pool (up to `ATTEMPTS` tries); a stream
that had started ends with an error output, and is billed for what it delivered.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from expresslane.engine.output import RequestOutput
from expresslane.engine.output_buffer import OutputBuffer
from expresslane.engine.request import Request
from expresslane.engine.request_factory import RequestFactory
from expresslane.engine.snapshot import EngineSnapshot
from expresslane.engine.submission import Submission
from expresslane.fleet.cluster_file import ClusterSpec, PoolSpec
from expresslane.fleet.router import prefix_hashes
from expresslane.fleet.token_channel import TokenInbox
from expresslane.lanes import LANE_NAMES, LaneCounts, build_lanes
from expresslane.model_source import resolve_model
from expresslane.models.config import ModelConfig
from expresslane.promise import Stated
from expresslane.server.errors import APIError

log = logging.getLogger("expresslane.fleet")
ATTEMPTS = 3
# The routes of the HTTP request being handled: a list the ingress middleware puts here
# (fleet/ingress.py) and reads back for the x-expresslane-pool/-replica headers.
current_routes: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "expresslane_routes", default=None
)


class _Busy(Exception):
    """A replica lending idle capacity to flex has work of its own tiers."""


class _Aborted(Exception):
    """Aborted before a replica was asked (an Exception, so the stream still ends)."""


class Route:
    """Where a request runs; `known` is set once a replica has answered (its first output,
    after which it is not retried elsewhere)."""

    def __init__(self, pool: str):
        self.pool = pool
        self.replica: str | None = None
        self.known = asyncio.Event()


class FleetStream:
    """One request's outputs at the ingress: the pump (`_run`) asks a pool, retrying as the
    module says; the replica's outputs arrive through the ingress's `TokenInbox` (`receive`)."""

    def __init__(self, engine: FleetEngine, req: Request, pools: list[PoolSpec], call: dict):
        self.request = req
        self.request_id = req.request_id
        self.route = Route(pools[0].name)
        self.finished = False
        self._engine, self._call = engine, call
        self._pool, self._spares = pools[0], pools[1:]  # where to go if a lent pool is busy
        self._response = None  # the Serve call of the current attempt
        self._tokens = 0  # delivered by the current attempt
        self._attempt_over = asyncio.Event()  # its last output came, or its replica was lost
        self._outputs = OutputBuffer()
        self._lost = False
        self.aborted = False

    def start(self) -> None:
        """Ask the pool now (on the running event loop), not when the consumer first reads:
        the response headers wait for the route, and a stream's body is read after them."""
        self._pump = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            await self._attempts()
        finally:
            self.route.known.set()
            self._engine.done(self)

    def receive(self, out: RequestOutput, replica: str) -> None:
        """An output of the current attempt (TokenInbox); the first names the route, and the
        response headers go with it (so a request retried before it names its new replica)."""
        if self.route.replica != replica or not self.route.known.is_set():
            self.route.replica = replica
            self._engine.routed(self)
            self.route.known.set()
        self._tokens += len(out.new_token_ids)
        self._outputs.put(out)
        if out.finished:
            self._attempt_over.set()

    def watch(self, callback: Callable[[RequestOutput], None]) -> None:
        """Call `callback` with each output as it arrives (before it is read)."""
        self._outputs.watch = callback

    def link_lost(self, replica: str) -> None:
        self._lost = True
        self._attempt_over.set()

    def cancel(self) -> None:
        self.aborted = True
        if self._response is not None:
            self._response.cancel()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        try:
            while not self.finished:
                out = await self._outputs.take()
                self.finished = out.finished
                yield out
        finally:
            if not self.finished:
                self.cancel()  # the consumer left: Serve cancels the call, which aborts it

    async def _attempts(self) -> None:
        for attempt in range(ATTEMPTS):
            try:
                await self._one_attempt(f"{self.request_id}#{attempt}")
                return
            except _Busy:  # a pool lending idle replicas to flex is not idle: the next pool
                self._engine.moved(self, self._spares[0])
                self._pool, self._spares = self._spares[0], self._spares[1:]
                self.route.pool = self._pool.name
            except Exception as e:  # the replica died or could not be reached, or aborted
                if self.aborted:
                    self._outputs.put(self._failed(None, "abort"))
                    return
                if self._tokens or attempt == ATTEMPTS - 1:
                    when = "after it had started answering" if self._tokens else f"{ATTEMPTS} times"
                    self._outputs.put(
                        self._failed(
                            f"the replica serving this request failed ({type(e).__name__}) "
                            f"{when}; retry the request"
                        )
                    )
                    return
                log.warning("%s: retrying on another replica (%s)", self.request_id, e)

    async def _one_attempt(self, key: str) -> None:
        """Until the attempt's last output arrived; raises if it failed."""
        if self.aborted:
            raise _Aborted
        inbox = self._engine.inbox
        handle = self._engine.handles[self._pool.name]
        lent = self.request.lane not in self._pool.tiers and bool(self._spares)
        self._attempt_over.clear()
        self._lost, self._tokens = False, 0
        inbox.expect(key, self)
        try:
            call = {**self._call, "lent": lent, "reply_to": inbox.address, "reply_key": key}
            self._response = handle.run_request.remote(call)
            reply = await self._reply(self._response)
            if reply.get("busy"):
                raise _Busy
            if "error" in reply:
                self.route.replica = reply["replica"]
                self._engine.routed(self)
                self._outputs.put(self._failed(reply["error"]))
                return
            await self._attempt_over.wait()  # the last frame may still be on its way
            if self._lost:
                raise ConnectionError("the replica's token connection closed")
        finally:
            inbox.forget(key)

    async def _reply(self, response) -> dict:
        """The replica's answer to the call, or {"done"} once the attempt's last output came:
        the call's return may trail its last frame, and until the attempt is over the
        request counts as in flight (a lent pool would look busy to the next request)."""
        reply = asyncio.ensure_future(response)
        over = asyncio.ensure_future(self._attempt_over.wait())
        try:
            await asyncio.wait([reply, over], return_when=asyncio.FIRST_COMPLETED)
        finally:
            over.cancel()
        if self._attempt_over.is_set():
            reply.add_done_callback(_outcome_ignored)
            return {"done": True}
        return reply.result()

    def _failed(self, error: str | None, reason: str = "error") -> RequestOutput:
        req = self.request
        req.metrics = replace(req.metrics, finished=time.perf_counter())
        return RequestOutput(
            req.request_id,
            [],
            "",
            True,
            reason,
            req.num_prompt_tokens,
            0,
            0,
            req.metrics,
            error=error,
        )


class FleetEngine:
    def __init__(
        self,
        spec: ClusterSpec,
        handles: dict,
        model_dir,
        host: str = "127.0.0.1",
        block_size: int = 16,
    ):
        self.spec = spec
        self.handles = handles  # pool name -> Ray Serve DeploymentHandle
        self.block_size = block_size
        model_dir = resolve_model(str(model_dir))
        mcfg = ModelConfig.from_dir(model_dir)
        self._lanes = build_lanes(_ingress_lanes(spec))
        max_len = min(
            p.engine.get("max_model_len") or min(mcfg.max_position_embeddings, 8192)
            for p in spec.pools.values()
        )
        self.factory = RequestFactory(model_dir, mcfg, self._lanes, max_len)
        self.ready = threading.Event()
        self.ready.set()
        self._streams: dict[str, FleetStream] = {}
        self._pool_load: dict[str, int] = dict.fromkeys(spec.pools, 0)
        self.lane_load = LaneCounts()  # requests in flight per lane
        self._routed: dict[tuple[str, str, str], int] = {}  # (pool, replica, tier) -> requests
        self.inbox = TokenInbox(host)

    async def start(self) -> None:
        """Open the port the replicas send tokens to (on the event loop that serves)."""
        await self.inbox.start()

    # -- what the server reads ---------------------------------------------------------------
    tokenizer = property(lambda self: self.factory.tokenizer)
    model_path = property(lambda self: self.spec.model)
    lanes = property(lambda self: self._lanes)
    max_model_len = property(lambda self: self.factory.max_model_len)
    vocab_size = property(lambda self: self.factory.vocab_size)
    sampling_defaults = property(lambda self: self.factory.sampling_defaults)

    def grammar_literal(self, text: str) -> str:
        return self.factory.grammars.literal(text)

    def is_alive(self) -> bool:
        return True

    def lane_room(self, lane: str, prompt_tokens: int) -> bool:
        """Room by count: the lane's max batch here is its pools' batch room."""
        return self.lane_load(lane) < self._lanes[lane].max_batch

    def promises(self) -> dict[str, Stated]:
        """The promises the cluster file states as numbers (an "auto" one is measured by
        each replica, and not published by the ingress)."""
        return {
            name: lane.promise.stated(0, 0)
            for name, lane in self._lanes.items()
            if lane.promise is not None and not lane.promise.is_auto
        }

    def snapshot(self) -> EngineSnapshot:
        """What this ingress has in flight (the replicas' own queues are theirs)."""
        return EngineSnapshot(running=self.lane_load.as_dict(), routed=dict(self._routed))

    def shutdown(self, timeout: float = 5.0) -> None:
        for stream in list(self._streams.values()):
            stream.cancel()

    # -- requests ----------------------------------------------------------------------------
    def make_request(self, sub: Submission) -> Request:
        return self.factory.make(sub)

    def pools_for(self, tier: str, regions: list[str] | None) -> list[PoolSpec]:
        """The pools a request of the tier may go to, best first: for flex, pools lending
        idle replicas before flex's own pools (a lending replica that has work of its own
        tiers turns the request away, and it goes to the next pool)."""
        pools = [
            p
            for p in self.spec.pools_for(tier, spare=True)
            if regions is None or p.region in regions
        ]

        def rank(p: PoolSpec) -> tuple:
            lent = tier not in p.tiers
            busy = lent and self._pool_load[p.name] > 0
            load = self._pool_load[p.name] / max(1, p.max_replicas or p.replicas)
            return (busy, not lent, load)

        return sorted(pools, key=rank)

    def check_placement(self, lane: str, regions: list[str] | None) -> None:
        """403 when no pool of the lane's tier is in a region the key may use."""
        self._placed(lane, regions)

    def _placed(self, tier: str, regions: list[str] | None) -> list[PoolSpec]:
        """`pools_for`, or the 403 of `check_placement` when there are none."""
        pools = self.pools_for(tier, regions)
        if not pools:
            raise APIError(
                403,
                f"No pool serves the {tier!r} tier in the regions this key may use "
                f"({', '.join(regions or [])}); pools of that tier are in "
                f"{sorted({p.region for p in self.spec.pools_for(tier, spare=True)})}.",
                param="service_tier",
                code="region_not_allowed",
            )
        return pools

    def enqueue(self, req: Request, regions: list[str] | None = None) -> FleetStream:
        pools = self._placed(req.lane, regions)
        pool = pools[0]
        prompt = req.token_ids[: req.num_prompt_tokens]
        call = {
            "prompt_token_ids": prompt,
            "params": req.params,
            "request_id": req.request_id,
            "lane": req.lane,
            "cache_salt": req.cache_salt,
            "tenant": req.tenant,
            "prefix_hashes": prefix_hashes(prompt, self.block_size, req.cache_salt),
        }
        stream = FleetStream(self, req, pools, call)
        routes = current_routes.get()
        if routes is not None:
            routes.append(stream.route)
        self._streams[req.request_id] = stream
        self._pool_load[pool.name] += 1
        self.lane_load.add(req.lane)
        stream.start()
        return stream

    def routed(self, stream: FleetStream) -> None:
        key = (stream.route.pool, stream.route.replica or "", stream.request.lane)
        self._routed[key] = self._routed.get(key, 0) + 1

    def moved(self, stream: FleetStream, pool: PoolSpec) -> None:
        self._pool_load[stream.route.pool] -= 1
        self._pool_load[pool.name] += 1

    def done(self, stream: FleetStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self._pool_load[stream.route.pool] -= 1
            self.lane_load.done(stream.request.lane)

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()


def _outcome_ignored(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it


def _ingress_lanes(spec: ClusterSpec) -> dict:
    """The lanes the ingress admits: the cluster's [lanes] settings, tiers no pool serves off,
    and each served lane's max_batch the batch room of all its pools' replicas (the key's
    `when_unavailable` policy applies beyond it)."""
    lanes = {name: dict(values) for name, values in spec.lanes.items()}
    for name in LANE_NAMES:
        room = sum(_batch_room(p, name) for p in spec.pools_for(name, spare=True))
        if name != "default":
            lanes.setdefault(name, {})["enabled"] = room > 0
        if room:
            lanes.setdefault(name, {}).setdefault("max_batch", room)
    return lanes


def _batch_room(pool: PoolSpec, tier: str) -> int:
    lane = build_lanes(pool.engine_options()["lanes"])[tier]
    per_replica = min(lane.max_batch, pool.engine.get("max_batch", 64))
    return per_replica * (pool.max_replicas or pool.replicas)
