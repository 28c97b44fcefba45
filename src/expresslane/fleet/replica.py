"""`EngineReplica`: one replica of a pool, an `LLMEngine` in a Ray Serve deployment.

The ingress validated and tokenized the request (`RequestFactory`); the replica makes it again
from the token ids (grammar matchers and detokenizers do not travel) and runs it. Its outputs
go to the ingress over the token channel (fleet/token_channel.py), one frame per engine step
for all that ingress's requests; the Serve call itself stays open until the request finished.
A call the ingress cancels (client gone) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

from ray import serve

from expresslane.engine.submission import Submission
from expresslane.errors import ExpresslaneError
from expresslane.fleet.load_board import report_loop
from expresslane.fleet.token_channel import TokenOutbox


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (direct use in tests)
        return f"local-{os.getpid()}"


def pin_process(cores: list[int]) -> None:
    """Every thread of this process on `cores`, not only the calling one (Linux pins threads
    one by one): Ray's transfer threads and Serve's event loop share the engine's GIL, and
    one of them descheduled on a busy core outside the pool's would stall the engine too.
    Threads started later inherit the pin of the thread that starts them."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux
        threads = [0]
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cores)


class EngineReplica:
    def __init__(
        self,
        pool: str,
        tiers: list[str],
        model: str | None,
        options: dict,
        threads: int = 1,
        cpu_affinity: list[int] | None = None,
        stream_interval: int = 1,
    ):
        import torch

        from expresslane.config import EngineConfig
        from expresslane.engine.async_engine import AsyncEngine
        from expresslane.engine.engine import LLMEngine

        if cpu_affinity:
            pin_process(cpu_affinity)
        # (No shorter GIL switch interval here, unlike the ingress: with Ray's threads asking
        # for the GIL, 0.5 ms cut an ultrafast replica's decode speed by two thirds.)
        torch.set_num_threads(max(1, threads))
        self.pool, self.tiers, self.stream_interval = pool, tiers, stream_interval
        self.replica = replica_id()
        self.engine = AsyncEngine(LLMEngine(EngineConfig.from_options(model, dict(options))))
        while not self.engine.ready.wait(1.0):
            if not self.engine.is_alive():
                raise RuntimeError("the engine stopped while starting")
        self._outboxes: dict[tuple[str, int], TokenOutbox] = {}
        self._outbox_lock = asyncio.Lock()
        self._stop_reports = threading.Event()
        report_loop(pool, self.replica, self.record_routing_stats, self._stop_reports)

    async def run_request(self, call: dict) -> dict:
        """Run one request, its outputs going to the ingress that sent it (`reply_to`, through
        a `TokenOutbox`); returns once it finished: {"done"}, {"error"} for a request this
        replica cannot make, or {"busy"} for work this pool lends idle capacity to (`lent`)
        while it has its own tiers' work. Cancelling the call aborts the request."""
        if call.get("lent") and any(self.engine.lane_load(t) for t in self.tiers):
            return {"busy": True}
        try:
            req = self.engine.make_request(
                Submission(
                    call["prompt_token_ids"],
                    call["params"],
                    call["request_id"],
                    call["lane"],
                    cache_salt=call["cache_salt"],
                    tenant=call.get("tenant"),
                )
            )
        except ExpresslaneError as e:
            return {"error": str(e), "replica": self.replica}
        outbox = await self._outbox(call["reply_to"])
        done = outbox.add(req.request_id, call["reply_key"])
        self.engine.enqueue_to(req, outbox)
        try:
            await done
        except BaseException:  # cancelled, or the ingress's connection is gone
            outbox.drop(req.request_id)
            self.engine.abort(req.request_id)
            raise
        return {"done": True}

    async def _outbox(self, address: dict) -> TokenOutbox:
        """The connection to an ingress, made on its first request (one at a time)."""
        key = (address["host"], address["port"])
        async with self._outbox_lock:
            outbox = self._outboxes.get(key)
            if outbox is None or outbox.closed:
                outbox = await TokenOutbox.open(
                    address, self.replica, self.stream_interval, self._outbox_closed
                )
                self._outboxes[key] = outbox
            return outbox

    def _outbox_closed(self, outbox: TokenOutbox) -> None:
        for key, open_one in list(self._outboxes.items()):
            if open_one is outbox:
                del self._outboxes[key]

    def record_routing_stats(self) -> dict:
        """What the router may weigh beside queue lengths (fleet/router.py)."""
        snap = self.engine.snapshot()
        return {
            "running": sum(snap.running.values()),
            "waiting": sum(snap.waiting.values()),
            "kv_used_blocks": snap.kv_used_blocks,
        }

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose health check raises."""
        if not self.engine.is_alive():
            raise RuntimeError("the engine's step loop stopped")

    async def __del__(self):
        """Ray Serve calls this when it stops the replica (after in-flight requests got
        `graceful_shutdown_timeout_s` to finish)."""
        self._stop_reports.set()
        await asyncio.to_thread(self.engine.shutdown)
        for outbox in list(self._outboxes.values()):
            outbox.close()
