"""The synchronous engine: admit requests, run one scheduler + model step at a time."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from expresslane.config import EngineConfig
from expresslane.engine.calibration import LaneTargets, calibrate
from expresslane.engine.dtypes import model_dtypes
from expresslane.engine.grammar import GrammarMatchers
from expresslane.engine.isolation import StepRun, device_fault, request_error, run_isolated
from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.output import OutputProcessor, RequestOutput
from expresslane.engine.parallel.group import TensorParallelGroup
from expresslane.engine.request import Request
from expresslane.engine.request_factory import RequestFactory
from expresslane.engine.runner import CacheConfig, ModelRunner, size_kv_cache
from expresslane.engine.scheduler import ScheduledBatch, Scheduler
from expresslane.engine.snapshot import EngineSnapshot
from expresslane.engine.speculation.component import Speculation
from expresslane.engine.speculation.payoff import StepGuesses
from expresslane.engine.step_model import StepLatencyModel
from expresslane.engine.submission import Submission
from expresslane.engine.window_blocks import window_pool
from expresslane.errors import InvalidRequestError
from expresslane.lanes import LaneCounts, build_lanes
from expresslane.models import load_model
from expresslane.models.config import ModelConfig
from expresslane.sampling_params import SamplingParams

log = logging.getLogger("expresslane.engine")
QUEUE_TIMEOUT = "queue_timeout"  # the error text of requests that waited too long to start


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.torch_device()
        self.model_dir = config.model_dir  # resolved once: a Hub name may ask the network
        mcfg = ModelConfig.from_dir(self.model_dir)
        self.parallel: TensorParallelGroup | None = None  # with tensor_parallel_size > 1
        try:
            self._start(config, mcfg)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, mcfg: ModelConfig) -> None:
        max_len = self._load_model(config, mcfg)
        kv = size_kv_cache(config, mcfg, self.dtype, max_len)
        self.kv_store, self.kv_bytes_per_token = kv.store, kv.bytes_per_token
        num_blocks, max_len = kv.num_blocks, kv.max_model_len
        self.max_model_len = self.factory.max_model_len = max_len
        window = window_pool(kv, mcfg, config.block_size)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, window
        )
        cache = CacheConfig(num_blocks, config.block_size, self.kv_store, kv.window_blocks)
        graphs = config.max_batch if config.cuda_graphs else None
        self.runner = ModelRunner(self.model, cache, config.seed, config.batch_invariant, graphs)
        self.runner.window_map = None if window is None else window.remap
        if self.parallel is not None:
            self.parallel.bind(self.model, cache, mcfg.vocab_size)
        log.info("execution plan: %s", self.model.plan.describe())
        # steps the C++ layer stack runs (decodes and verifications up to its row limit) cost
        # other than larger ones: the step-latency model fits them on a line of their own
        self.step_model = StepLatencyModel(small_tokens=max(self.model.plan.stack_rows, 8))
        self.scheduler = Scheduler(config, self.kv, self.lanes, self.step_model)
        self.outputs = OutputProcessor(self.tokenizer, max_len)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.targets = LaneTargets(self.lanes, self.scheduler, self.step_model)
        self.speculation = Speculation(
            config,
            self.lanes,
            self.step_model,
            device=self.device,
            max_model_len=max_len,
            kv_blocks=(num_blocks, config.block_size),
            target_vocab_size=self.model_config.vocab_size,
        )

    def _load_model(self, config: EngineConfig, mcfg: ModelConfig) -> int:
        """Weights, lanes and the request factory; the context length they allow."""
        self.dtype, linear_dtype = model_dtypes(config, mcfg.torch_dtype, self.device)
        max_len = config.max_model_len or min(mcfg.max_position_embeddings, 8192)
        if mcfg.sliding_window:
            max_len = min(max_len, mcfg.sliding_window)  # no sliding-window attention yet
        if config.tensor_parallel_size > 1:  # the workers load their shards meanwhile
            self.parallel = TensorParallelGroup(config, max_len)
        self.model, self.model_config = load_model(
            self.model_dir,
            self.dtype,
            self.device,
            max_len,
            linear_dtype,
            config.quantization,
            self.parallel.shard if self.parallel is not None else None,
        )
        self.lanes = build_lanes(config.lanes)
        self.factory = RequestFactory(
            self.model_dir,
            mcfg,
            self.lanes,
            max_len,
            Path(config.tokenizer) if config.tokenizer else None,
            self.device.type != "cpu",  # on a CPU the forward pass keeps every core busy
        )
        self.tokenizer = self.factory.tokenizer
        self.eos_token_ids = self.factory.eos_token_ids
        self._grammars = self.factory.grammars
        return max_len

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine runs no step after)."""
        if self.parallel is not None:
            self.parallel.close()

    @property
    def healthy(self) -> bool:
        """False once the engine cannot run steps any more (a tensor-parallel rank died)."""
        return self.parallel is None or self.parallel.error is None

    def snapshot(self) -> EngineSnapshot:
        """A copy of what the server reports (server/metrics.py); safe from another thread:
        it copies the scheduler's lists before counting."""
        return EngineSnapshot(
            LaneCounts.of(r.lane for r in list(self.scheduler.running)).as_dict(),
            LaneCounts.of(r.lane for r in list(self.scheduler.waiting)).as_dict(),
            self.targets.per_request(),
            self.speculation.counts(),
            self.kv.num_used_blocks,
            self.kv.num_blocks,
        )

    # -- requests -----------------------------------------------------------------------

    def make_request(self, sub: Submission) -> Request:
        """Validate and tokenize a `Submission` (`RequestFactory.make`); touches no engine
        state, so it is safe to call from another thread."""
        return self.factory.make(sub)

    @property
    def grammars(self) -> GrammarMatchers:
        """Constrained decoding (it needs the model's tokenizer.json)."""
        if self._grammars is None:
            raise InvalidRequestError("constrained decoding needs the model's tokenizer.json")
        return self._grammars

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running")
        if req.lane not in self.lanes:
            raise InvalidRequestError(f"request {req.request_id!r}: unknown lane {req.lane!r}")
        most = self.config.max_waiting
        if most is not None and len(self.scheduler.waiting) >= most:
            raise InvalidRequestError(f"the engine's queue is full ({most} requests waiting)")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def add_request(self, prompt: str | list[int], params: SamplingParams, **kwargs) -> Request:
        req = self.make_request(Submission(prompt, params, **kwargs))
        self.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._remove(req)
        self.outputs.finish(req, "abort")
        return self.outputs.make_output(req, 0)

    def _remove(self, req: Request) -> None:
        self.scheduler.remove(req)
        self.speculation.release(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: propose guesses, schedule, run the model, accept the tokens."""
        start = time.perf_counter()
        if self.targets.due:
            self.targets.resolve()
        self.speculation.propose(self.scheduler.running, self._grammars is not None)
        expired = self._expire_waiting()
        batch = self.scheduler.schedule()
        if not batch.items:
            return expired
        guesses = self._started(batch.items)
        run = self._run(batch.items)
        outputs = expired + self._fail_step_errors(run)
        emitted = self._accept_all(run, outputs)
        self._retire(run)
        if run.clean:  # retries are no measure of what a step costs
            self._time_step(batch, guesses, time.perf_counter() - start, emitted)
        return outputs

    def _started(self, items: list[tuple[Request, int]]) -> StepGuesses:
        """Mark the scheduled requests' first scheduling; the step's guesses, before it runs."""
        self.num_steps += 1
        now = time.perf_counter()
        for req, _ in items:
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = now
        return self.speculation.started(req for req, _ in items)

    def _run(self, items: list[tuple[Request, int]]) -> StepRun:
        """The model step, grammar masks included, without the requests that raise."""
        masks = self._grammars.start(items) if self._grammars is not None else None
        return run_isolated(lambda part: self.runner.step(part, masks), items)

    def _accept_all(self, run: StepRun, outputs: list[RequestOutput]) -> int:
        """Append each request's output to `outputs`; the number of tokens emitted."""
        for req, n in run.items:
            req.num_computed_tokens += n - len(req.spec.guesses)
        row = emitted = 0
        for req, rows in run.samples:
            outputs.append(self._emit(req, run.result, row, rows))
            row += rows
            emitted += len(outputs[-1].new_token_ids)
        return emitted

    def _retire(self, run: StepRun) -> None:
        """Cache the step's full blocks; take the finished requests out."""
        for req, _ in run.items:
            if req.finish_reason != "error":  # a request that failed may hold partial KV
                self.kv.cache_full_blocks(req)  # finished ones too: a next turn may reuse them
            self.kv.slide(req)
            if req.is_finished:
                self._remove(req)
                self.requests.pop(req.request_id, None)

    def _time_step(
        self, batch: ScheduledBatch, guesses: StepGuesses, seconds: float, emitted: int
    ) -> None:
        """What the step cost: for the step-latency model and speculation's payoff."""
        seqs, tokens = len(batch.items), batch.num_tokens
        self.step_model.record(seqs, tokens, batch.context_tokens, seconds)
        self.scheduler.credit.settle(seconds)
        self.speculation.step_timed(guesses, seqs, tokens, seconds, emitted)

    # -- faults -------------------------------------------------------------------------

    def _emit(self, req: Request, result, row: int, rows: int) -> RequestOutput:
        """The request's output for its sampled rows; an error output, for this request
        only, if taking them raises."""
        try:
            appended = self._accept(req, result, row, rows)
            complete = self._grammars is not None and self._grammars.advance(req, appended)
            if complete and not req.is_finished and req.token_ids[-1] in self.eos_token_ids:
                self.outputs.finish(req, "stop")  # ignore_eos, but the grammar is complete
            return self.outputs.make_output(req, appended)
        except Exception as e:
            log.exception("request %s: accepting its tokens failed", req.request_id)
            self.outputs.finish(req, "error")
            return self.outputs.make_output(req, 0, error=request_error(e))

    def _fail_step_errors(self, run: StepRun) -> list[RequestOutput]:
        """End the requests the model step raised for. When every request of the batch
        failed alone (a device fault), also drop what the prefix cache holds."""
        outputs = [self._fail(req, run.error_message(e)) for req, e in run.failed]
        if run.device_fault:
            device_fault(self.kv, self.device)
        return outputs

    def _expire_waiting(self) -> list[RequestOutput]:
        """Fail the requests that waited longer than `max_queue_seconds` in the queue, to
        start or, preempted, to resume: an overloaded server answers them (429 queue_timeout)
        instead of letting them wait on."""
        limit = self.config.max_queue_seconds
        if limit is None or not self.scheduler.waiting:
            return []
        oldest = time.perf_counter() - limit
        stale = [r for r in self.scheduler.waiting if r.metrics.queued < oldest]
        message = f"{QUEUE_TIMEOUT}: the request waited {limit:g} s in the queue"
        return [self._fail(req, message) for req in stale]

    def _fail(self, req: Request, message: str) -> RequestOutput:
        """End a request with an error; its blocks go back to the pool."""
        self._remove(req)
        self.requests.pop(req.request_id, None)
        self.outputs.finish(req, "error")
        return self.outputs.make_output(req, 0, error=message)

    def _accept(self, req: Request, result, row: int, rows: int) -> int:
        """Append the sampled token, or for speculation the guesses the model agrees with
        plus its own next token. Returns how many tokens were appended."""
        guesses = req.spec.take_guesses()
        appended = 0
        for j in range(rows):
            token = result.token_ids[row + j]
            lp = result.logprobs[row + j] if result.logprobs else None
            self.outputs.append_token(req, token, lp)
            appended += 1
            if req.is_finished or j == len(guesses) or token != guesses[j]:
                break
        if guesses:
            # KV is valid up to the last accepted guess; roll back the rest.
            req.num_computed_tokens += appended - 1
            self.kv.trim(req, req.num_computed_tokens)
        if self.speculation.accepted(req, len(guesses), appended):
            self.scheduler.observe_tokens_per_step(req.lane, appended)
        return appended

    # -- step-latency model ---------------------------------------------------------------

    def calibrate(self) -> None:
        """Fit the step-latency model to timed synthetic steps (engine/calibration.py)."""
        calibrate(self)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with an error (when a step raised outside the model step's
        isolation), then start over from an empty KV pool, so that the next requests find
        none of the bookkeeping the failed step may have left half done."""
        outs = [self._fail(req, message) for req in list(self.requests.values())]
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self.kv.reset()
        return outs
