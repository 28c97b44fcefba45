"""A request's speculation state: the guesses it verifies next, and its record of past ones.

"Guesses" are the tokens proposed to be verified in the next step, whoever proposed them: an
n-gram lookup, a draft model (draft.py) or the request's grammar (the tokens it forces).
The planner (planner.py) fills them, the scheduler cuts them to the step's budget, the
runner scores them, and the engine's acceptance takes them back (verification.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from expresslane.engine.speculation.acceptance import Tally


@dataclass
class SpecState:
    guesses: list[int] = field(default_factory=list)  # tokens to verify in the next step
    guess_probs: torch.Tensor | None = None  # [guesses, vocab]: the q they were drawn from
    kind: int = 0  # the proposal's kind (proposal.py)
    padding: int = 0  # filler tokens ending `guesses` (planner.py `uniform`)
    forced: bool = False  # the guesses are what its grammar forces, not a proposal
    tallies: dict[int, Tally] = field(default_factory=dict)  # verified guesses per kind
    verifications: int = 0  # steps that verified its guesses

    def propose(self, guesses: list[int], probs: torch.Tensor | None, kind: int) -> None:
        """A proposer's guesses (`probs`: the q they were drawn from; None: deterministic)."""
        self.guesses, self.padding, self.forced = guesses, 0, False
        self.guess_probs = probs
        self.kind = kind

    def force(self, tokens: list[int]) -> None:
        """The tokens the request's grammar forces next, verified like any guess."""
        self.guesses = tokens
        self.padding, self.guess_probs = 0, None
        self.forced = bool(tokens)

    def keep_guesses(self, n: int) -> None:
        """Drop all but the first n guesses (pads, at the end, go first)."""
        real = len(self.guesses) - self.padding
        del self.guesses[n:]
        self.padding = max(0, len(self.guesses) - real)

    def clear_guesses(self) -> None:
        """No guesses this step (a proposer raised)."""
        self.keep_guesses(0)
        self.guess_probs = None

    def pad_to(self, length: int, last_token: int) -> None:
        """Pad the guesses to `length` with their last token (`last_token` when there are
        none); a pad is a certain guess, so its q is one-hot. Longer guesses are cut."""
        pad = length - len(self.guesses)
        if pad <= 0:
            self.keep_guesses(length)
            return
        filler = (self.guesses or [last_token])[-1]
        self.guesses += [filler] * pad
        self.padding += pad
        if self.guess_probs is not None:
            q = self.guess_probs[: len(self.guesses) - pad]
            extra = q.new_zeros(pad, q.shape[1])
            extra[:, filler] = 1.0
            self.guess_probs = torch.cat([q, extra])

    def take_guesses(self) -> list[int]:
        """The guesses just verified; the request has none until the next proposal."""
        guesses, self.guesses = self.guesses, []
        return guesses

    def verified(self, num_guesses: int, appended: int) -> tuple[int, int, bool]:
        """Close the verification of `num_guesses` guesses (pads included) that appended
        `appended` tokens: (guesses proposed, guesses kept, whether they were forced)."""
        self.verifications += 1
        proposed = num_guesses - self.padding  # pads are not guesses
        kept = min(appended - 1, proposed)
        forced, self.padding, self.forced = self.forced, 0, False
        return proposed, kept, forced
