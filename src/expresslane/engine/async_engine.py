"""`AsyncEngine`: the engine's step loop on a background thread, per-request async streams.

The model step runs on its own thread (PyTorch releases the GIL while it computes), so the
server's event loop stays responsive. Requests are validated and tokenized on the caller's
side (`make_request`), so bad input fails fast with an `InvalidRequestError` and never reaches
the loop; a step that raises all the same fails only the requests that make it raise
(engine/isolation.py). `abort(request_id)` takes effect before the next step: the request's KV
blocks are released and its stream ends with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from expresslane.engine.calibration import Calibration
from expresslane.engine.engine import LLMEngine
from expresslane.engine.openmp import name_thread, release_team
from expresslane.engine.output import RequestOutput
from expresslane.engine.output_buffer import OutputBuffer
from expresslane.engine.request import Request
from expresslane.engine.snapshot import EngineSnapshot
from expresslane.engine.submission import Submission
from expresslane.lanes import LaneCounts
from expresslane.promise import Stated
from expresslane.sampling_params import SamplingParams

log = logging.getLogger("expresslane.engine")
STEP_THREAD = "expresslane-eng"  # the step loop's OS thread name, its OpenMP workers' too


class OutputSink(Protocol):
    """Where the step loop sends requests' outputs: `deliver` runs on the event loop that
    enqueued them, once per step, with that step's outputs of all the sink's requests."""

    def deliver(self, outputs: list[RequestOutput]) -> None: ...


class RequestStream:
    """Async iterator over one request's outputs; ends after the finished output."""

    def __init__(self, request: Request, engine: AsyncEngine):
        self.request = request
        self.request_id = request.request_id
        self._engine = engine
        self._outputs = OutputBuffer()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._outputs.put(out)

    def watch(self, callback: Callable[[RequestOutput], None]) -> None:
        """Call `callback` with each output as the engine hands it over (before it is read)."""
        self._outputs.watch = callback

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await self._outputs.take()
                self.finished = out.finished
                yield out
        finally:
            if not self.finished:  # the consumer went away (client disconnect, cancel)
                self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, calibrate: bool | None = None, serve_while_calibrating=False
    ):
        """`calibrate`: the engine config's by default. `serve_while_calibrating`: ready at
        once, the calibration measured between requests; else ready once it is measured."""
        self.engine = engine
        self._calibrate = engine.config.calibrate if calibrate is None else calibrate
        self._serve_while_calibrating = serve_while_calibrating
        self.lane_load = LaneCounts()  # requests submitted and not finished, per lane
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, tuple[OutputSink, asyncio.AbstractEventLoop, str]] = {}
        self._lock = threading.Lock()
        self._stop = False
        self.ready = threading.Event()  # set once stepping (calibrated, unless serving meanwhile)
        release_team()  # the step loop's OpenMP team must be the only one (engine/openmp.py)
        self._thread = threading.Thread(target=self._loop, name=STEP_THREAD, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        """Whether the step loop thread is running, on an engine that can run steps."""
        return self._thread.is_alive() and not self._stop and self.engine.healthy

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_path(self) -> str | None:
        """The model directory as configured; None for the bundled demo model."""
        return self.engine.config.model or None

    @property
    def lanes(self):
        return self.engine.lanes

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def sampling_defaults(self) -> dict:
        return self.engine.factory.sampling_defaults

    def grammar_literal(self, text: str) -> str:
        """`text` as a grammar literal for this model's tokenizer (engine/grammar.py)."""
        return self.engine.grammars.literal(text)

    def snapshot(self) -> EngineSnapshot:
        """Queues, lane targets, speculation counters and KV use, copied now."""
        return self.engine.snapshot()

    def lane_room(self, lane: str, prompt_tokens: int) -> bool:
        scheduler = self.engine.scheduler
        return scheduler.has_room(lane, prompt_tokens, self.lane_load(lane))

    def promises(self) -> dict[str, Stated]:
        return dict(self.engine.scheduler.room.stated)

    def submit(self, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Validate and enqueue a default-lane request; must be called from a running event
        loop (a shorthand for `enqueue(make_request(Submission(prompt, params)))`)."""
        return self.enqueue(self.make_request(Submission(prompt, params)))

    def make_request(self, sub: Submission) -> Request:
        """Validate and tokenize without enqueuing (raises InvalidRequestError)."""
        return self.engine.factory.make(sub)

    def check_placement(self, lane: str, regions: list[str] | None) -> None:
        """One process serves every lane it has wherever its key may be served."""

    def enqueue(self, req: Request, regions: list[str] | None = None) -> RequestStream:
        """Hand a request made by `make_request` to the step loop; returns its stream
        (`regions` concern fleets only)."""
        stream = RequestStream(req, self)
        self.enqueue_to(req, stream)
        return stream

    def enqueue_to(self, req: Request, sink: OutputSink) -> None:
        """`enqueue`, with the request's outputs going to `sink` (shared by many requests:
        a fleet replica's connection to an ingress) rather than to a stream of its own."""
        with self._lock:
            if req.request_id in self._sinks:
                raise ValueError(f"request id {req.request_id!r} is already in flight")
            self._sinks[req.request_id] = (sink, asyncio.get_running_loop(), req.lane)
            self.lane_load.add(req.lane)
        self._inbox.put(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort whatever is in flight and stop the loop thread."""
        with self._lock:
            ids = list(self._sinks)
        for rid in ids:
            self.abort(rid)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()

    # -- the loop thread ----------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One hand-over per sink per step (a sink's requests' outputs in one list)."""
        batches: dict[int, tuple[OutputSink, asyncio.AbstractEventLoop, list]] = {}
        with self._lock:
            for out in outputs:
                entry = self._sinks.get(out.request_id)
                if entry is None:
                    continue
                sink, loop, lane = entry
                if out.finished:
                    del self._sinks[out.request_id]
                    self.lane_load.done(lane)
                batches.setdefault(id(sink), (sink, loop, []))[2].append(out)
        for sink, loop, outs in batches.values():
            with contextlib.suppress(RuntimeError):  # that event loop may be closed
                loop.call_soon_threadsafe(sink.deliver, outs)

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                try:
                    self.engine.add(item)
                except ValueError as e:
                    self.engine.outputs.finish(item, "error")
                    outputs.append(self.engine.outputs.make_output(item, 0, error=str(e)))
            else:
                out = self.engine.abort(item)
                if out is not None:
                    outputs.append(out)

    def _loop(self) -> None:
        name_thread(STEP_THREAD)
        eng = self.engine
        calibration = self._start_calibration()
        # What exists now (model, tokenizer, caches) lives as long as the engine: keep it out
        # of the garbage collector's scans, whose pauses would show up as step-time spikes.
        gc.freeze()
        self.ready.set()
        while not self._stop:
            self._deliver(self._drain_inbox())
            if calibration is not None and not calibration.done and calibration.turn():
                continue
            if not eng.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            steps = eng.num_steps
            try:
                outputs = eng.step()
                if eng.num_steps == steps and not outputs:
                    self._wake.wait(0.002)  # nothing could run: do not spin on the GIL
                    self._wake.clear()
            except Exception as e:  # outside the model step's isolation: a bug in the engine
                log.exception("engine step failed")  # must not hang every client
                outputs = eng.fail_all(f"internal engine error: {type(e).__name__}: {e}")
            self._deliver(outputs)
        self._deliver(self._drain_inbox())

    def _start_calibration(self) -> Calibration | None:
        """The kept calibration taken, or one to measure between requests; None when this
        engine does not calibrate (or could not start to)."""
        if not self._calibrate:
            return None
        try:
            calibration = Calibration(self.engine)
        except Exception:  # serving uncalibrated beats not serving: the model fits online
            log.exception("step-latency calibration failed")
            self.engine.targets.held = False
            return None
        while not (self._serve_while_calibrating or calibration.done or self._stop):
            calibration.step()
        return calibration
