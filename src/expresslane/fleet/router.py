"""`PrefixAffinityRouter`: Ray Serve's request router for a pool, by cached prefix and load.

Each call carries `prefix_hashes`, the chained hashes of its prompt's full KV blocks
(`prefix_hashes` below, the same blocks the engine's prefix cache keys on). The router
remembers which replica it last sent each block to. A request goes to the replica holding the
longest run of its leading blocks, unless that replica carries more than `imbalance` requests
beyond the least loaded one; then, and for prompts nothing matches, to the least loaded one.
So a conversation continued with `previous_response_id` returns to the replica that has its
earlier turns cached, and a hot prefix cannot pile every request onto one replica. The state
is per ingress replica and approximate (as SGLang's cache-aware router): a wrong guess costs a
prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MAX_BLOCKS = 200_000  # remembered block owners (LRU); ~40 bytes of hash each


def prefix_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """Chained hashes of the full blocks of `token_ids` (a block's hash covers all before it)."""
    out, digest = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in block))
        digest = h.digest()
        out.append(digest.hex())
    return out


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4):
        self._imbalance = imbalance
        self._owners: OrderedDict[str, ReplicaID] = OrderedDict()

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def _matched(self, hashes: list[str], replica_id: ReplicaID) -> int:
        n = 0
        for h in hashes:
            if self._owners.get(h) != replica_id:
                break
            n += 1
        return n

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=lambda r: (self._load(r), random.random()))
        hashes = _hashes(pending_request)
        if not hashes:
            return [by_load]
        least = self._load(by_load[0])
        best = max(candidate_replicas, key=lambda r: self._matched(hashes, r.replica_id))
        if self._matched(hashes, best.replica_id) and self._load(best) <= least + self._imbalance:
            return [[best], [r for r in by_load if r is not best]]
        return [by_load]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        for h in _hashes(pending_request):
            self._owners[h] = replica_id
            self._owners.move_to_end(h)
        while len(self._owners) > MAX_BLOCKS:
            self._owners.popitem(last=False)


def _hashes(pending_request: PendingRequest | None) -> list[str]:
    if pending_request is None or not pending_request.args:
        return []
    call = pending_request.args[0]
    return call.get("prefix_hashes", []) if isinstance(call, dict) else []
