"""`TenantShares`: a lane's running slots per tenant (an API key) while the scheduler admits
that lane's waiting requests. In a lane with a `key_share` below 1, a tenant that holds its share
(that fraction of the lane's max batch, at least one slot) starts no more, so another tenant's
request always finds a slot within one request's time; the rest of its requests wait. Requests
without a tenant (offline use, a server in open mode, an operator's key) have no share."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from expresslane.engine.request import Request
from expresslane.lanes import Lane


class TenantShares:
    def __init__(self, lane: Lane, running: Iterable[Request]):
        self.share = max(1, math.ceil(lane.key_share * lane.max_batch))
        self.limited = lane.key_share < 1
        self.held = Counter(r.tenant for r in running if r.lane == lane.name)

    def held_back(self, req: Request) -> bool:
        """Whether `req` waits because its tenant holds its share of the lane's slots."""
        return self.limited and req.tenant is not None and self.held[req.tenant] >= self.share

    def started(self, req: Request) -> None:
        self.held[req.tenant] += 1
