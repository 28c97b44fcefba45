"""The synchronous engine: admit requests, run one scheduler + model step at a time."""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path

from expresslane.config import EngineConfig
from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.output import OutputProcessor, RequestOutput, TextState
from expresslane.engine.request import Request
from expresslane.engine.runner import ModelRunner, kv_bytes_per_block
from expresslane.engine.scheduler import Scheduler
from expresslane.errors import ContextLengthExceeded, InvalidRequestError
from expresslane.models import load_model
from expresslane.models.config import ModelConfig
from expresslane.sampling_params import SamplingParams
from expresslane.spec import make_proposer
from expresslane.spec.stats import SpecStats
from expresslane.tokenizer import Tokenizer

log = logging.getLogger("expresslane.engine")
_ids = itertools.count()


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return eos if isinstance(eos, list) else ([] if eos is None else [eos])


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = config.model_dir
        self.device = config.torch_device()
        mcfg = ModelConfig.from_dir(model_dir)
        self.dtype, linear_dtype = config.dtypes(mcfg.torch_dtype, self.device)
        max_len = config.max_model_len or min(mcfg.max_position_embeddings, 8192)
        if mcfg.sliding_window:
            max_len = min(max_len, mcfg.sliding_window)  # no sliding-window attention yet
        self.model, self.model_config = load_model(
            model_dir, self.dtype, self.device, max_len, linear_dtype
        )
        tok_dir = Path(config.tokenizer) if config.tokenizer else model_dir
        self.tokenizer = (
            Tokenizer.from_dir(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        )
        eos = set(mcfg.eos_token_ids) | set(_generation_eos(model_dir))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

        per_block = kv_bytes_per_block(mcfg, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gb * 2**30 // per_block)
        capacity = num_blocks * config.block_size
        if capacity < max_len:
            log.warning(
                "KV cache holds %d tokens: max_model_len lowered from %d", capacity, max_len
            )
            max_len = capacity
        self.max_model_len = max_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_batch, config.max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model, mcfg, num_blocks, config.block_size, self.dtype, self.device, config.seed
        )
        self.outputs = OutputProcessor(self.tokenizer, max_len)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.proposer, self.spec_tokens = (None, 0)
        if config.speculative:
            self.proposer, self.spec_tokens = make_proposer(config.speculative)
        self.spec_stats = SpecStats()

    # -- requests -----------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> Request:
        """Validate and tokenize; raises InvalidRequestError. Touches no engine state, so
        it is safe to call from another thread."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: pass token ids", param="prompt"
                )
            ids, text = self.tokenizer.encode(prompt, add_special_tokens), prompt
        else:
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(
                    f"token ids must be integers in [0, {vocab})", param="prompt"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {len(ids)} tokens but this model's context is "
                f"{self.max_model_len} tokens (prompt plus output); shorten the prompt",
                param="prompt",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ContextLengthExceeded(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"this model's context of {self.max_model_len} tokens; lower max_tokens to at "
                f"most {room}",
                param="max_tokens",
            )
        req = Request(
            request_id if request_id is not None else f"req-{next(_ids)}",
            ids,
            params,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            prompt=text,
            max_tokens=params.max_tokens or room,
        )
        if self.tokenizer is not None:
            req.detok = TextState(self.tokenizer, req)
        return req

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def add_request(self, prompt: str | list[int], params: SamplingParams, **kwargs) -> Request:
        req = self.make_request(prompt, params, **kwargs)
        self.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req)
        self.outputs.finish(req, "abort")
        return self.outputs.make_output(req, 0)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        self.num_steps += 1
        now = time.perf_counter()
        for req, _ in batch.items:
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = now
        samples, result = self.runner.step(batch.items)
        for req, n in batch.items:
            req.num_computed_tokens += n - len(req.draft_ids)
        outputs: list[RequestOutput] = []
        row = 0
        for req, rows in samples:
            accepted = self._accept(req, result, row, rows)
            row += rows
            outputs.append(self.outputs.make_output(req, accepted))
        for req, _ in batch.items:
            self.kv.cache_full_blocks(req)  # finished ones too: a next turn may reuse them
            if req.is_finished:
                self.scheduler.remove(req)
                self.requests.pop(req.request_id, None)
        return outputs

    def _accept(self, req: Request, result, row: int, rows: int) -> int:
        """Append the sampled token, or for speculation the guesses the model agrees with
        plus its own next token. Returns how many tokens were appended."""
        drafts, req.draft_ids = req.draft_ids, []
        appended = 0
        for j in range(rows):
            token = result.token_ids[row + j]
            lp = result.logprobs[row + j] if result.logprobs else None
            self.outputs.append_token(req, token, lp)
            appended += 1
            if req.is_finished or j == len(drafts) or token != drafts[j]:
                break
        if drafts:
            # KV is valid up to the last accepted guess; roll back the rest.
            req.num_computed_tokens += appended - 1
            self.kv.trim(req, req.num_computed_tokens)
            self.spec_stats.record(len(drafts), appended - 1)
        return appended

    def _propose(self) -> None:
        """Guess the next tokens of greedy requests that are decoding."""
        k = self.spec_tokens
        for req in self.scheduler.running:
            p = req.params
            decoding = req.num_computed_tokens == req.num_tokens - 1
            if not decoding or not p.greedy or req.num_output_tokens < p.min_tokens:
                continue
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
            if room > 1:
                req.draft_ids = self.proposer.propose(req.token_ids, min(k, room - 1))

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with an error (used when a step raised)."""
        outs = []
        for req in list(self.requests.values()):
            self.scheduler.remove(req)
            self.outputs.finish(req, "error")
            outs.append(self.outputs.make_output(req, 0, error=message))
        self.requests.clear()
        return outs
