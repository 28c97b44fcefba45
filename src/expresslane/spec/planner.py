"""How many tokens each decoding request guesses in the next step (speculative decoding).

`GuessPlanner.propose` asks each lane's proposer for guesses and sizes them: per request from
its acceptance rate for the proposal's kind (spec/acceptance.py) and the step-latency model,
then one common count for the whole batch, so that the verification runs as one uniform
batch. The engine verifies what is planned here (engine.py `_accept`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from expresslane.engine.request import Request
from expresslane.engine.step_model import StepLatencyModel
from expresslane.lanes import Lane
from expresslane.spec import SpecConfig, best_length, expected_tokens, proposal_length
from expresslane.spec.payoff import SpecPayoff

MAX_FORCED = 16  # most grammar-forced tokens a request verifies in one step


class GuessPlanner:
    def __init__(
        self,
        proposers: dict[int, SpecConfig],
        lanes: dict[str, Lane],
        step_model: StepLatencyModel,
        payoff: SpecPayoff,
        max_model_len: int,
    ):
        self.proposers = proposers  # lane rank -> SpecConfig (the engine's, shared)
        self.lanes = lanes
        self.step_model = step_model
        self.payoff = payoff
        self.max_model_len = max_model_len

    def propose(self, running: list[Request]) -> None:
        """Guess the next tokens of requests that are decoding, one proposer call per lane.
        Lanes without a speed target stop guessing while the running batch is past where
        verification pays, or while guessing is measured to be slower than not at this batch
        size (`SpecPayoff`, adaptive lanes). Adaptive lanes choose each request's number of
        guesses from its acceptance rate for the proposal's kind (spec/acceptance.py) and the
        step-latency model (`best_length`): most tokens per second. A free proposer (a lookup)
        is asked for the most guesses and its proposal cut to that length; others are asked
        for that length."""
        pays = self.payoff.speculate(len(running))
        wanted: dict[int, tuple[list[Request], list[int]]] = {}
        for req in running:
            spec = self.proposers.get(req.priority)
            if spec is None:
                continue
            if not self._keeps_guessing(req) and (
                (spec.max_batch is not None and len(running) > spec.max_batch)
                or (spec.adaptive and not pays)
            ):
                continue
            room = self.room(req)
            if room <= 0:
                continue
            reqs, lengths = wanted.setdefault(req.priority, ([], []))
            reqs.append(req)
            lengths.append(min(spec.num_tokens, room))
        if not wanted:
            return
        costs = self.step_model.cost_line(len(running), sum(r.num_tokens for r in running))
        size = self._proposal_sizer(running, costs)
        for rank, (reqs, lengths) in wanted.items():
            spec = self.proposers[rank]
            free = spec.proposer.free
            if not free:
                lengths = [size(spec, r, 0, k) for r, k in zip(reqs, lengths, strict=True)]
            proposals = spec.proposer.propose(reqs, lengths)
            for req, k, proposal in zip(reqs, lengths, proposals, strict=True):
                guesses = proposal.token_ids[:k]
                if free and guesses:
                    guesses = guesses[: size(spec, req, proposal.kind, len(guesses))]
                req.draft_ids, req.draft_padding, req.draft_forced = guesses, 0, False
                req.draft_probs = proposal.probs
                req.draft_kind = proposal.kind
        self.uniform(running, costs)

    def add_forced(self, running: list[Request]) -> None:
        """A constrained request with no guesses guesses the tokens its grammar forces next
        (a JSON key, the markup closing a call): verified like any guess, they cost a row
        each and come out in the same step, and the output is what it would be without."""
        for req in running:
            if req.matcher is None or req.draft_ids:
                continue  # guesses kept from a step that capped it stay what they were
            room = min(self.room(req), MAX_FORCED)
            if room > 0:
                req.draft_ids = req.matcher.compute_ff_tokens()[:room]
                req.draft_padding, req.draft_probs = 0, None
                req.draft_forced = bool(req.draft_ids)

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
        """Give every decoding request the same number of guesses, so that the step runs as
        one uniform batch (the native decode step, or one padded attention batch): with mixed
        lengths the guessing requests go through the prompt-chunk path, which measured slower
        than not guessing (0.92x at batch 2, 0.59x at batch 8 on the demo model). The common
        length is the one the step-latency model expects to yield the most tokens per second
        (before it is fitted: the median, which cuts or pads the fewest guesses). Longer
        proposals are cut to it; shorter ones are padded with their last token. A pad is
        verified like any guess (a sampled request's pad has a one-hot q), so it costs rows
        but leaves the output exact: the same tokens when greedy, the same distribution when
        sampled. Pads are not counted as guesses."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        lengths = sorted({len(r.draft_ids) for r in decoding})
        if len(lengths) <= 1:
            return

        def reachable(req: Request, k: int) -> bool:
            # pads may run past max_tokens (tokens stop there), not past the model's context;
            # a request short of min_tokens masks EOS on all its rows alike, so gets none
            if len(req.draft_ids) >= k:
                return True
            return (
                req.num_output_tokens >= req.params.min_tokens
                and req.num_tokens + k <= self.max_model_len
            )

        # lanes with a speed target keep guessing at any batch: their guesses are never cut
        floor = max((len(r.draft_ids) for r in decoding if self._keeps_guessing(r)), default=0)
        options = [k for k in lengths if k >= floor and all(reachable(r, k) for r in decoding)]
        if not options:
            return
        if costs is None:  # the fewest guesses cut or pads added: the median length
            median = sorted(len(r.draft_ids) for r in decoding)[(len(decoding) - 1) // 2]
            best = min(options, key=lambda k: abs(k - median))
        else:
            rates = {id(r): self._acceptance(r) for r in decoding}

            def tokens_per_second(k: int) -> float:
                tokens = sum(
                    expected_tokens(rates[id(r)], min(len(r.draft_ids), k)) for r in decoding
                )
                return tokens / max(costs(len(decoding) * (k + 1)), 1e-9)

            best = max(options, key=tokens_per_second)
        for req in decoding:
            pad = best - len(req.draft_ids)
            if pad > 0:
                filler = (req.draft_ids or req.token_ids)[-1]
                req.draft_ids += [filler] * pad
                req.draft_padding += pad
                if req.draft_probs is not None:  # a pad is a certain guess: q is one-hot
                    q = req.draft_probs[: len(req.draft_ids) - pad]
                    extra = q.new_zeros(pad, q.shape[1])
                    extra[:, filler] = 1.0
                    req.draft_probs = torch.cat([q, extra])
            else:
                req.keep_guesses(best)

    def _keeps_guessing(self, req: Request) -> bool:
        return req.priority in self.proposers and (
            self.lanes[req.lane].target_tokens_per_s is not None
        )

    def _acceptance(self, req: Request) -> float:
        spec = self.proposers.get(req.priority)
        if spec is None or not req.draft_ids:
            return 0.0
        return spec.acceptance.rate(req.spec_tallies, req.draft_kind)

    def _proposal_sizer(self, running: list[Request], costs: Callable[[int], float] | None):
        """size(spec, req, kind, most): how many guesses `req` verifies this step, chosen in
        turn for the requests of the batch (each choice sees the guesses chosen before it).
        `costs`: the step-latency model's seconds by step tokens (None before it is fitted)."""
        extra, expected = 0, float(len(running))  # guesses so far, tokens the batch yields

        def size(spec: SpecConfig, req: Request, kind: int, most: int) -> int:
            nonlocal extra, expected
            a = spec.acceptance.rate(req.spec_tallies, kind)
            k = most
            if spec.adaptive and costs is not None:
                base = len(running) + extra
                k = best_length(a, most, lambda n: costs(base + n), expected - 1)
            elif spec.adaptive:
                k = proposal_length(a, most)
            extra += k
            expected += expected_tokens(a, k) - 1
            return k

        return size
