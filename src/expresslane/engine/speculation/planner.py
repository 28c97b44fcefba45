"""How many tokens each decoding request guesses in the next step (speculative decoding).

`GuessPlanner.propose` asks each lane's proposer for guesses and sizes them: per request from
its acceptance rate for the proposal's kind (acceptance.py) and the step-latency model,
then one common count for the whole batch, so that the verification runs as one uniform
batch. The guesses go into each request's `req.spec` (state.py); the engine verifies them
(engine.py `_accept`, verification.py).
"""

from __future__ import annotations

from collections.abc import Callable

from expresslane.engine.request import Request
from expresslane.engine.speculation import SpecConfig, best_length, expected_tokens, proposal_length
from expresslane.engine.speculation.payoff import SpecPayoff
from expresslane.engine.step_model import StepLatencyModel
from expresslane.lanes import Lane

MAX_FORCED = 16  # most grammar-forced tokens a request verifies in one step


class GuessPlanner:
    def __init__(
        self,
        proposers: dict[str, SpecConfig],
        lanes: dict[str, Lane],
        step_model: StepLatencyModel,
        payoff: SpecPayoff,
        max_model_len: int,
    ):
        self.proposers = proposers  # lane name -> SpecConfig (the engine's, shared)
        self.lanes = lanes
        self.step_model = step_model
        self.payoff = payoff
        self.max_model_len = max_model_len

    def propose(self, running: list[Request]) -> None:
        """Guess the next tokens of requests that are decoding, one proposer call per lane.
        Lanes without a speed target stop guessing while the running batch is past where
        verification pays, or while guessing is measured to be slower than not at this batch
        size (`SpecPayoff`, adaptive lanes). Adaptive lanes choose each request's number of
        guesses from its acceptance rate for the proposal's kind (acceptance.py) and the
        step-latency model (`best_length`): most tokens per second. A free proposer (a lookup)
        is asked for the most guesses and its proposal cut to that length; others are asked
        for that length."""
        pays = self.payoff.speculate(len(running))
        wanted = self._wanted(running, pays)
        if not wanted:
            return
        costs = self.step_model.cost_line(len(running), sum(r.num_tokens for r in running))
        size = self._proposal_sizer(running, costs)
        for lane, (reqs, lengths) in wanted.items():
            spec_config = self.proposers[lane]
            free = spec_config.proposer.free
            if not free:
                lengths = [size(spec_config, r, 0, k) for r, k in zip(reqs, lengths, strict=True)]
            proposals = spec_config.proposer.propose(reqs, lengths)
            for req, k, proposal in zip(reqs, lengths, proposals, strict=True):
                guesses = proposal.token_ids[:k]
                if free and guesses:
                    guesses = guesses[: size(spec_config, req, proposal.kind, len(guesses))]
                req.spec.propose(guesses, proposal.probs, proposal.kind)
        self.uniform(running, costs)

    def _wanted(
        self, running: list[Request], pays: bool
    ) -> dict[str, tuple[list[Request], list[int]]]:
        """Per lane, the requests that guess this step and the most guesses each may take."""
        wanted: dict[str, tuple[list[Request], list[int]]] = {}
        for req in running:
            spec_config = self.proposers.get(req.lane)
            if spec_config is None:
                continue
            if not self._keeps_guessing(req) and (
                (spec_config.max_batch is not None and len(running) > spec_config.max_batch)
                or (spec_config.adaptive and not pays)
            ):
                continue
            room = self.room(req)
            if room <= 0:
                continue
            reqs, lengths = wanted.setdefault(req.lane, ([], []))
            reqs.append(req)
            lengths.append(min(spec_config.num_tokens, room))
        return wanted

    def add_forced(self, running: list[Request]) -> None:
        """A constrained request with no guesses guesses the tokens its grammar forces next
        (a JSON key, the markup closing a call): verified like any guess, they cost a row
        each and come out in the same step, and the output is what it would be without."""
        for req in running:
            if req.matcher is None or req.spec.guesses:
                continue  # guesses kept from a step that capped it stay what they were
            room = min(self.room(req), MAX_FORCED)
            if room > 0:
                req.spec.force(req.matcher.compute_ff_tokens()[:room])

    def room(self, req: Request) -> int:
        """How many guesses `req` may verify in the next step (0: none: not decoding, short
        of min_tokens, or at its token limit)."""
        if req.num_computed_tokens != req.num_tokens - 1:
            return 0
        if req.num_output_tokens < req.params.min_tokens:
            return 0
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return max(room - 1, 0)

    def uniform(self, running: list[Request], costs: Callable[[int], float] | None) -> None:
        """Give every decoding request of the speculating lanes the same number of guesses
        (those of other lanes are left alone: pads cost them rows for no token), so that the
        step runs as one uniform batch (the C++ layer stack, or one padded attention batch):
        with mixed lengths the guessing requests go through the prompt-chunk path, which
        measured slower than not guessing (0.92x at batch 2, 0.59x at batch 8 on the demo
        model). The common
        length is the one the step-latency model expects to yield the most tokens per second
        (before it is fitted: the median, which cuts or pads the fewest guesses). Longer
        proposals are cut to it; shorter ones are padded with their last token. A pad is
        verified like any guess (a sampled request's pad has a one-hot q), so it costs rows
        but leaves the output exact: the same tokens when greedy, the same distribution when
        sampled. Pads are not counted as guesses."""
        decoding = [
            r
            for r in running
            if r.lane in self.proposers and r.num_computed_tokens == r.num_tokens - 1
        ]
        lengths = sorted({len(r.spec.guesses) for r in decoding})
        if len(lengths) <= 1:
            return

        def reachable(req: Request, k: int) -> bool:
            # pads may run past max_tokens (tokens stop there), not past the model's context;
            # a request short of min_tokens masks EOS on all its rows alike, so gets none
            if len(req.spec.guesses) >= k:
                return True
            return (
                req.num_output_tokens >= req.params.min_tokens
                and req.num_tokens + k <= self.max_model_len
            )

        # lanes with a speed target keep guessing at any batch: their guesses are never cut
        floor = max((len(r.spec.guesses) for r in decoding if self._keeps_guessing(r)), default=0)
        options = [k for k in lengths if k >= floor and all(reachable(r, k) for r in decoding)]
        if not options:
            return
        if costs is None:  # the fewest guesses cut or pads added: the median length
            median = sorted(len(r.spec.guesses) for r in decoding)[(len(decoding) - 1) // 2]
            best = min(options, key=lambda k: abs(k - median))
        else:
            rates = {id(r): self._acceptance(r) for r in decoding}

            def tokens_per_second(k: int) -> float:
                tokens = sum(
                    expected_tokens(rates[id(r)], min(len(r.spec.guesses), k)) for r in decoding
                )
                return tokens / max(costs(len(decoding) * (k + 1)), 1e-9)

            best = max(options, key=tokens_per_second)
        for req in decoding:
            req.spec.pad_to(best, req.token_ids[-1])

    def _keeps_guessing(self, req: Request) -> bool:
        return req.lane in self.proposers and (self.lanes[req.lane].target_tokens_per_s is not None)

    def _acceptance(self, req: Request) -> float:
        spec_config = self.proposers.get(req.lane)
        if spec_config is None or not req.spec.guesses:
            return 0.0
        return spec_config.acceptance.rate(req.spec.tallies, req.spec.kind)

    def _proposal_sizer(self, running: list[Request], costs: Callable[[int], float] | None):
        """size(spec_config, req, kind, most): how many guesses `req` verifies this step, chosen in
        turn for the requests of the batch (each choice sees the guesses chosen before it).
        `costs`: the step-latency model's seconds by step tokens (None before it is fitted)."""
        extra, expected = 0, float(len(running))  # guesses so far, tokens the batch yields

        def size(spec_config: SpecConfig, req: Request, kind: int, most: int) -> int:
            nonlocal extra, expected
            a = spec_config.acceptance.rate(req.spec.tallies, kind)
            k = most
            if spec_config.adaptive and costs is not None:
                base = len(running) + extra
                k = best_length(a, most, lambda n: costs(base + n), expected - 1)
            elif spec_config.adaptive:
                k = proposal_length(a, most)
            extra += k
            expected += expected_tokens(a, k) - 1
            return k

        return size
