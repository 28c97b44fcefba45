"""The prefix record behind the router: which replica holds the longest cached prefix.
Plain Python, no Ray cluster needed."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from expresslane.fleet import records  # noqa: E402
from expresslane.fleet.records import PrefixRecord  # noqa: E402
from expresslane.fleet.router import prefix_hashes  # noqa: E402

BLOCK = 4


def test_hashes_cover_full_blocks_and_chain():
    a = prefix_hashes(list(range(10)), BLOCK)
    b = prefix_hashes([99] + list(range(1, 10)), BLOCK)
    assert len(a) == 2  # the partial last block is not cached, so not hashed
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later hash
    assert prefix_hashes(list(range(8)), BLOCK) == a


def test_one_owners_prompt_never_matches_anothers():
    """Routing keys are seeded with the owner's cache salt, as the engine's cache is: tenant
    B's prompt finds no replica through tenant A's blocks."""
    record = PrefixRecord()
    prompt = list(range(12))
    record.record(prefix_hashes(prompt, BLOCK, "key:alice"), "A")
    assert record.owner_depths(prefix_hashes(prompt, BLOCK, "key:bob")) == {}
    assert record.owner_depths(prefix_hashes(prompt, BLOCK)) == {}  # the unsalted (open) root
    assert record.owner_depths(prefix_hashes(prompt, BLOCK, "key:alice")) == {"A": 3}


def test_the_deepest_block_wins_over_a_shared_first_block():
    record = PrefixRecord()
    system = list(range(8))
    chat = system + list(range(100, 112))
    record.record(prefix_hashes(chat, BLOCK), "A")  # turn 1 of a conversation on A
    record.record(prefix_hashes(system + [7, 7, 7, 7], BLOCK), "B")  # another chat, same system
    turn2 = chat + list(range(200, 208))
    depths = record.owner_depths(prefix_hashes(turn2, BLOCK))
    assert depths == {"B": 2, "A": 5}


def test_an_unknown_prompt_matches_nothing():
    record = PrefixRecord()
    record.record(prefix_hashes(list(range(8)), BLOCK), "A")
    assert record.owner_depths(prefix_hashes(list(range(50, 58)), BLOCK)) == {}
    assert record.owner_depths([]) == {}


def test_a_lookup_keeps_the_blocks_it_found(monkeypatch):
    """The router does not record a request again when it goes to the replica holding its
    whole prompt: the lookup itself must keep those blocks from being evicted first."""
    monkeypatch.setattr(records, "MAX_BLOCKS", 2)
    record = PrefixRecord()
    record.record(["a"], "A")
    record.record(["b"], "B")
    assert record.owner_depths(["a"]) == {"A": 1}
    record.record(["c"], "C")  # one too many: the least recently used goes
    assert record.owner_depths(["a"]) == {"A": 1}
    assert record.owner_depths(["b"]) == {}


async def test_a_local_record_answers_as_the_shared_one():
    """One ingress replica keeps its routers' records in its own process (`LocalPrefixes`)."""
    local = records.LocalPrefixes()
    local.record(prefix_hashes(list(range(12)), BLOCK), "A")
    assert await local.depths(prefix_hashes(list(range(16)), BLOCK)) == {"A": 3}
