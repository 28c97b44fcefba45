"""`EngineReplica`: one replica of a pool, an `LLMEngine` in a Ray Serve deployment.

The ingress validated and tokenized the request (`RequestFactory`); the replica makes it again
from the token ids (grammar matchers and detokenizers do not travel) and streams its outputs.
The first item of every stream names the pool and replica, for the response headers (the
ingress sends them with the first output, so a request retried before it names its new
replica). A stream the ingress drops (client gone) is cancelled by Ray, and the request's
stream aborts it in the engine (async_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator

from ray import serve

from expresslane.engine.output import merge_outputs
from expresslane.engine.submission import Submission
from expresslane.errors import ExpresslaneError
from expresslane.fleet.load_board import report_loop


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
        torch.set_num_threads(max(1, threads))
        self.pool, self.tiers, self.stream_interval = pool, tiers, stream_interval
        self.replica = replica_id()
        self.engine = AsyncEngine(LLMEngine(EngineConfig.from_options(model, dict(options))))
        while not self.engine.ready.wait(1.0):
            if not self.engine.is_alive():
                raise RuntimeError("the engine stopped while starting")
        self._stop_reports = threading.Event()
        report_loop(pool, self.replica, self.record_routing_stats, self._stop_reports)

    async def generate(self, call: dict) -> AsyncIterator[object]:
        """{"pool", "replica"} first, then the request's `RequestOutput`s; or only {"busy"}
        for work this pool lends idle capacity to (`lent`) while it has its own tiers' work."""
        if call.get("lent") and any(self.engine.lane_load(t) for t in self.tiers):
            yield {"busy": True}
            return
        yield {"pool": self.pool, "replica": self.replica}
        try:
            req = self.engine.make_request(
                Submission(
                    call["prompt_token_ids"],
                    call["params"],
                    call["request_id"],
                    call["lane"],
                    cache_salt=call["cache_salt"],
                )
            )
        except ExpresslaneError as e:
            yield e
            return
        stream = self.engine.enqueue(req)
        pending: list = []
        sent_first = False
        async for out in stream:
            # what piled up while the last item travelled goes as one: one hop, not many
            pending += [out, *stream.ready()]
            gathered = sum(len(o.new_token_ids) for o in pending)
            if not sent_first or pending[-1].finished or gathered >= self.stream_interval:
                yield merge_outputs(pending)
                pending, sent_first = [], True

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
