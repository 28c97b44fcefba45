"""Block pool bookkeeping: allocation, reference counts, prefix reuse and eviction."""

from __future__ import annotations

from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.request import Request
from expresslane.engine.submission import Submission
from expresslane.sampling_params import SamplingParams


def req(ids, rid="r", salt=None):
    return Request(rid, list(ids), SamplingParams(), max_tokens=16, cache_salt=salt)


def computed(kv: KVCacheManager, r: Request) -> Request:
    assert kv.allocate(r, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return r


def test_allocate_and_release_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = computed(kv, req(list(range(10))))
    assert len(a.block_ids) == 3 and kv.num_free_blocks == 5
    assert not kv.allocate(req(list(range(40)), "b"), 40)  # needs 10 > 5 free
    kv.release(a)
    assert kv.num_free_blocks == 8 and all(b.ref_count == 0 for b in kv.blocks)


def test_shared_prefix_is_reused_and_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = computed(kv, req(list(range(10))))
    b = req(list(range(8)) + [99, 98, 97], "b")
    assert kv.acquire_prefix(b) == 8
    assert b.block_ids == a.block_ids[:2]
    assert kv.blocks[a.block_ids[0]].ref_count == 2
    kv.release(a)
    assert kv.blocks[b.block_ids[0]].ref_count == 1
    kv.release(b)
    assert kv.num_free_blocks == 8


def test_cached_prefix_survives_release_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = computed(kv, req(list(range(9))))  # 2 full blocks cached, 1 partial
    kv.release(a)
    again = req(list(range(9)), "again")
    assert kv.acquire_prefix(again) == 8  # revived from the free queue
    kv.release(again)
    filler = computed(kv, req(list(range(100, 116)), "filler"))  # takes all 4 blocks
    kv.release(filler)
    assert kv.acquire_prefix(req(list(range(9)), "late")) == 0  # evicted


def test_at_least_one_token_is_left_to_compute():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.release(computed(kv, req(list(range(8)))))
    same = req(list(range(8)), "same")
    assert kv.acquire_prefix(same) == 4


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    kv.release(computed(kv, req(list(range(9)))))
    assert kv.acquire_prefix(req(list(range(9)), "b")) == 0


def test_trim_rolls_back_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req(list(range(6)))
    assert kv.allocate(r, 14)
    assert len(r.block_ids) == 4
    kv.trim(r, 6)
    assert len(r.block_ids) == 2 and kv.num_free_blocks == 6


def test_cache_salt_starts_its_own_hash_chain():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = computed(kv, req(range(9), "shared"))
    shared = first.block_ids[:2]
    kv.release(first)
    second = req(range(9), "salted", salt="tenant-1")
    assert kv.acquire_prefix(second) == 0  # the unsalted blocks are no hit
    salted = computed(kv, second).block_ids[:2]
    assert not set(salted) & set(shared)
    kv.release(second)
    assert kv.acquire_prefix(req(range(9), "other", salt="tenant-2")) == 0
    same = req(range(9), "same", salt="tenant-1")
    assert kv.acquire_prefix(same) == 8 and same.block_ids == salted
    plain = req(range(9), "plain")
    assert kv.acquire_prefix(plain) == 8 and plain.block_ids == shared


def test_requests_with_different_salts_share_no_cached_prompt(llama_dir):
    from expresslane import LLM

    engine = LLM(str(llama_dir), dtype="float32").engine
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(salt):
        r = engine.make_request(Submission(prompt, params, cache_salt=salt))
        engine.add(r)
        while engine.has_unfinished():
            engine.step()
        return r

    first = run("alice")
    assert first.num_cached_tokens == 0
    other = run("bob")
    assert other.num_cached_tokens == 0  # alice's prompt is cached, not for bob
    assert run("alice").num_cached_tokens == 48  # three full blocks of 16
    assert run(None).num_cached_tokens == 0
    assert run(None).num_cached_tokens == 48
    assert other.output_token_ids == first.output_token_ids
    assert engine.kv.num_used_blocks == 0
