"""`PrefixAffinityRouter`: Ray Serve's request router for a pool, by cached prefix and load.

Each call carries `prefix_hashes`, the chained hashes of its prompt's full KV blocks
(`prefix_hashes` below, the same blocks the engine's prefix cache keys on), seeded with the
request's cache salt (its owner's, `server/admission.py` `prefix_salt`): as in the engine's
cache, one tenant's prompt never matches another's, so where a request is routed says
nothing about other tenants' prompts. The routers
of all ingress replicas share one record per pool (`PrefixRecord`, in the fleet's records
actor: records.py) of the replica each block was last sent to; a fleet of one ingress replica
keeps it in the router's own process. A request goes to the replica holding the longest run of
its leading blocks, unless that replica carries more than `imbalance` requests beyond the
least loaded one; then, and for prompts nothing matches, to the least loaded one. So a
conversation continued with `previous_response_id` returns to the replica that has its earlier
turns cached, and a hot prefix cannot pile every request onto one replica. The record is
approximate (as SGLang's cache-aware router): a wrong guess costs a prefill, never a wrong
answer.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from expresslane.fleet.records import LocalPrefixes, SharedPrefixes

MAX_PENDING = 4096  # lookups remembered until their requests are routed


def prefix_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[str]:
    """Chained hashes of the full blocks of `token_ids` (a block's hash covers all before it,
    and the salt)."""
    out = []
    digest = b"" if salt is None else hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in block))
        digest = h.digest()
        out.append(digest.hex())
    return out


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, pool: str = "", shared: bool = True):
        self._imbalance = imbalance
        self._prefixes = SharedPrefixes(pool) if shared else LocalPrefixes()
        # a prompt's last block -> the replica its lookup found holding it, until the prompt
        # is routed: routed there, the record already says so (and the lookup refreshed it)
        self._holders: dict[str, str] = {}

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

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
        depths = await self._prefixes.depths(hashes)
        self._remember_holder(hashes, depths)
        held = [r for r in candidate_replicas if depths.get(r.replica_id.unique_id)]
        held.sort(key=lambda r: -depths[r.replica_id.unique_id])
        if held and self._load(held[0]) <= self._load(by_load[0]) + self._imbalance:
            # One replica per rank: within a rank Ray Serve takes the least loaded.
            return [[r] for r in held] + [[r for r in by_load if r not in held]]
        return [by_load]

    def _remember_holder(self, hashes: list[str], depths: dict[str, int]) -> None:
        if len(self._holders) > MAX_PENDING:  # lookups whose requests were never routed
            self._holders.clear()
        holder = next((r for r, depth in depths.items() if depth == len(hashes)), None)
        if holder is not None:
            self._holders[hashes[-1]] = holder

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        hashes = _hashes(pending_request)
        if hashes and self._holders.pop(hashes[-1], None) != replica_id.unique_id:
            self._prefixes.record(hashes, replica_id.unique_id)


def _hashes(pending_request: PendingRequest | None) -> list[str]:
    if pending_request is None or not pending_request.args:
        return []
    call = pending_request.args[0]
    return call.get("prefix_hashes", []) if isinstance(call, dict) else []
