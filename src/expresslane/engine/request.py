"""A request's life inside the engine: its tokens, its KV blocks, its timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from expresslane.engine.speculation.state import SpecState
from expresslane.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Output tokens after the first before a request's recent speed is reported
RECENT_TOKENS = 8


@dataclass
class RequestMetrics:
    """Engine-side timings in seconds (time.perf_counter clock) and derived speeds."""

    arrival: float
    queued: float = 0.0  # when it last joined the waiting queue (arrival, or a preemption)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    last_token: float | None = None
    # the time between its output tokens lately: a moving average (a token's weight 1/8)
    recent_gap: float | None = None
    num_gaps: int = 0

    def token_at(self, now: float) -> None:
        """An output token was appended at `now` (tokens of one step share it)."""
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            gap = now - self.last_token
            last = self.recent_gap
            self.recent_gap = gap if last is None else 0.875 * last + 0.125 * gap
            self.num_gaps += 1
        self.last_token = now

    @property
    def recent_tokens_per_s(self) -> float | None:
        """Its decode speed lately, once it has made `RECENT_TOKENS` tokens (None before)."""
        if self.num_gaps < RECENT_TOKENS or not self.recent_gap:
            return None
        return 1.0 / self.recent_gap

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


class Request:
    """Token ids are kept as one list: the prompt, then the output as it grows."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        lane: str = "default",
        eos_token_ids: frozenset[int] = frozenset(),
        prompt: str | None = None,
        max_tokens: int,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.lane = lane  # its lane's name (lanes.py): the scheduler orders by the lane's rank
        self.turn = 0  # when the scheduler last ran it (for round robin)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.min_tokens_ids = frozenset(params.stop_token_ids) | eos_token_ids
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks
        self.window_start = 0  # its first block whose window-layer KV it still holds
        self.cache_salt = cache_salt  # the chain's root: only equal salts share cached blocks
        self.tenant = tenant  # whose it is: a lane's share per tenant (engine/scheduler.py)
        self.spec = SpecState()  # its speculative guesses and their record (speculation/state.py)
        self.metrics = RequestMetrics(arrival=time.perf_counter())
        self.generator: torch.Generator | None = None
        self.logprobs: list[dict] = []
        # entry k: prompt token k's logprob (none for the first), as they are computed
        self.prompt_logprobs: list[dict | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.detok = None  # set by the engine's output processor
        self.matcher = None  # its grammar's llguidance matcher (engine/grammar.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
