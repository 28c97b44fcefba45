"""`Speculation`: the engine's one owner of speculative decoding. The engine calls it at a few
named points of its step and knows nothing else of it:

- `propose` before scheduling: the running requests' guesses (their lanes' proposers, or the
  tokens their grammars force; `planner.py`);
- `started` when the step is scheduled: its guesses, counted before it runs;
- `accepted` after a request's verification: books it (`verification.py`), returns whether the
  request's lane speculates (its tokens per step then feed the scheduler's targets);
- `step_timed` after a step: whether guessing pays at this batch size (`payoff.py`);
- `release` when a request leaves; `counts` for the snapshot the server reports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from expresslane.config import EngineConfig
from expresslane.demo import DRAFT_DIR, demo_model_dir
from expresslane.engine.dtypes import model_dtypes
from expresslane.engine.request import Request
from expresslane.engine.snapshot import SpecCounts
from expresslane.engine.speculation import SpecConfig, make_proposer
from expresslane.engine.speculation.draft import DraftModelProposer
from expresslane.engine.speculation.payoff import SpecPayoff, StepGuesses
from expresslane.engine.speculation.planner import GuessPlanner
from expresslane.engine.speculation.stats import SpecStats
from expresslane.engine.speculation.verification import record_verification
from expresslane.engine.step_model import StepLatencyModel
from expresslane.lanes import Lane
from expresslane.model_source import resolve_model
from expresslane.models.config import ModelConfig

log = logging.getLogger("expresslane.engine")


class Speculation:
    """Each lane's proposer (`proposers`, by lane name), the draft models they share, the
    counters (`stats` over all lanes, `lane_stats` per lane), the payoff measure (`payoff`)
    and the planner that sizes each step's guesses (`planner`)."""

    def __init__(
        self,
        config: EngineConfig,
        lanes: dict[str, Lane],
        step_model: StepLatencyModel,
        *,
        device,
        max_model_len: int,
        kv_blocks: tuple[int, int],
        target_vocab_size: int,
    ):
        self._config, self._device = config, device
        self._max_model_len, self._kv_blocks = max_model_len, kv_blocks
        self._target_vocab_size = target_vocab_size
        self._drafts: dict[Path, DraftModelProposer] = {}  # lanes share a draft model
        self.proposers: dict[str, SpecConfig] = {}
        for lane in lanes.values():
            settings = lane.speculative if lane.speculative is not None else config.speculative
            if settings:
                self.proposers[lane.name] = make_proposer(settings, device.type, self._load_draft)
        self.stats = SpecStats()
        self.lane_stats = {name: SpecStats() for name in lanes}
        self.payoff = SpecPayoff()
        self.planner = GuessPlanner(self.proposers, lanes, step_model, self.payoff, max_model_len)

    def _load_draft(self, model: str | None) -> DraftModelProposer:
        path = resolve_model(model) if model else demo_model_dir(DRAFT_DIR)
        if path not in self._drafts:
            dtype, linear_dtype = model_dtypes(
                self._config, ModelConfig.from_dir(path).torch_dtype, self._device
            )
            num_blocks, block_size = self._kv_blocks
            self._drafts[path] = DraftModelProposer(
                path,
                dtype=dtype,
                linear_dtype=linear_dtype,
                device=self._device,
                max_model_len=self._max_model_len,
                num_blocks=num_blocks,
                block_size=block_size,
                target_vocab_size=self._target_vocab_size,
                seed=self._config.seed,
            )
        return self._drafts[path]

    def speculates(self, lane: str) -> bool:
        return lane in self.proposers

    def propose(self, running: list[Request], grammars: bool) -> None:
        """Guess the next tokens of the running requests: their lanes' proposals, then (with
        `grammars`) the tokens their grammars force. Guesses are optional: when a proposer
        raises, this step runs without any (a proposer's per-request state is synced again
        before its next proposal)."""
        if self.proposers:
            try:
                self.planner.propose(running)
            except Exception:
                log.exception("speculative proposal failed: the step runs without guesses")
                for req in running:
                    req.spec.clear_guesses()
        if grammars:
            self.planner.add_forced(running)

    def started(self, reqs: Iterable[Request]) -> StepGuesses:
        """The scheduled step's guesses, counted before it runs."""
        return StepGuesses.of(reqs)

    def accepted(self, req: Request, num_guesses: int, appended: int) -> bool:
        """Book a step's outcome for `req`: `num_guesses` verified, `appended` tokens kept.
        Whether the request's lane speculates."""
        spec_config = self.proposers.get(req.lane)
        if num_guesses:
            counters = (self.stats, self.lane_stats[req.lane])
            record_verification(req.spec, spec_config, num_guesses, appended, counters)
        return spec_config is not None

    def step_timed(
        self, guesses: StepGuesses, seqs: int, tokens: int, seconds: float, emitted: int
    ) -> None:
        """A clean step's time: whether guessing pays at this batch size."""
        if self.proposers:
            self.payoff.record_step(guesses, seqs, tokens, seconds, emitted)

    def release(self, req: Request) -> None:
        """The request left the engine: its proposer forgets it."""
        spec_config = self.proposers.get(req.lane)
        if spec_config is not None:
            spec_config.proposer.release(req.request_id)

    def counts(self) -> dict[str, SpecCounts]:
        """Per lane: verification steps, guesses proposed and accepted."""
        return {
            lane: SpecCounts(s.steps, s.proposed, s.accepted) for lane, s in self.lane_stats.items()
        }
