"""How often guesses are kept: the estimate that sizes each proposal.

The model behind `expected_tokens`: a guess is kept with probability a when every guess before
it was. A verification that keeps `kept` of k guesses tried kept + 1 of them if it stopped at a
miss (the guesses after a miss are never compared) and k if it kept them all; a is estimated as
kept / tried.

Estimates are per proposal kind, because a proposer knows some of its guesses to be better than
others: n-gram lookup tells a four-token match, usually inside a long copy of the prompt, from a
one-token match, right about a third of the time (benchmarks/spec.py's edit workload). A
request's estimate for a kind starts at its lane's and moves to the request's own record as its
guesses are verified; older verifications count for less, since a request moves between copying
and writing.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97  # weight of a tally's past at each new verification
PRIOR_GUESSES = 16.0  # the lane's estimate counts as this many tried guesses of the request's
LANE_START = 0.75  # a lane's estimate before any verification


@dataclass
class Tally:
    kept: float = 0.0
    tried: float = 0.0

    def add(self, kept: int, tried: int) -> None:
        self.kept = DECAY * self.kept + kept
        self.tried = DECAY * self.tried + tried


def guesses_tried(kept: int, proposed: int) -> int:
    return proposed if kept >= proposed else kept + 1


class LaneAcceptance:
    """Tallies per kind for one lane's proposer: the prior of its requests' estimates."""

    def __init__(self) -> None:
        self.tallies: dict[int, Tally] = {}

    def _lane(self, kind: int) -> Tally:
        # the starting estimate weighs as 4 tried guesses and fades like any other record
        return self.tallies.setdefault(kind, Tally(LANE_START * 4, 4.0))

    def rate(self, own: dict[int, Tally], kind: int) -> float:
        """The estimate for a request whose own tallies are `own`."""
        lane = self._lane(kind)
        prior = lane.kept / lane.tried
        t = own.get(kind)
        if t is None:
            return prior
        return (PRIOR_GUESSES * prior + t.kept) / (PRIOR_GUESSES + t.tried)

    def record(self, own: dict[int, Tally], kind: int, kept: int, proposed: int) -> None:
        tried = guesses_tried(kept, proposed)
        self._lane(kind).add(kept, tried)
        own.setdefault(kind, Tally()).add(kept, tried)
