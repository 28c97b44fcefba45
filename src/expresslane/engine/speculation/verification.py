"""What a verification tells: the bookkeeping after the target model scored a request's guesses.

The engine appends the tokens the model agrees with (engine.py `_accept`) and rolls its KV back
past them; this books the verification: the request's own record (state.py), the counters
(stats.py) and the lane's acceptance estimates (acceptance.py) that size its next
proposals. Pads and the tokens a grammar forces are verified like guesses but not counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from expresslane.engine.speculation import SpecConfig
from expresslane.engine.speculation.state import SpecState
from expresslane.engine.speculation.stats import SpecStats


def record_verification(
    state: SpecState,
    spec_config: SpecConfig | None,
    num_guesses: int,
    appended: int,
    counters: Iterable[SpecStats],
) -> None:
    """Book the verification of `num_guesses` guesses that appended `appended` tokens.
    `spec_config`: the request's lane's speculation (None: the lane does not speculate);
    `counters`: the stats to count the proposed and kept guesses in."""
    proposed, kept, forced = state.verified(num_guesses, appended)
    if forced or spec_config is None or not proposed:
        return
    for stats in counters:
        stats.record(proposed, kept)
    spec_config.acceptance.record(state.tallies, state.kind, kept, proposed)
