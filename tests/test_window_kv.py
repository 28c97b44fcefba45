"""The sliding-window layers' own KV pool (engine/window_blocks.py): a request holds only its
window's blocks there, and greedy tokens stay transformers' with prompts and outputs several
windows long (windows of 8 over blocks of 4), in chunks, preempted, with n-gram guesses rolled
back, and over prefixes another request's window still holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig
from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.request import Request
from expresslane.engine.runner import size_kv_cache
from expresslane.engine.window_blocks import WindowBlocks
from expresslane.models.config import ModelConfig
from expresslane.perplexity import perplexity

from .conftest import random_prompts, reference_perplexity
from .test_gemma3 import gemma3_dir  # noqa: F401
from .test_gpt_oss import gpt_oss_dir  # noqa: F401
from .test_model_parity import hf_greedy, hf_model

GREEDY = dict(temperature=0, ignore_eos=True)
WINDOWED = dict(dtype="float32", block_size=4)  # the checkpoints' windows are 8: two blocks
BOUND = 8 // 4 + 1  # window blocks a request holds between steps


def _request(tokens: list[int]) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=8), max_tokens=8)


def test_window_blocks_are_given_back_as_the_window_moves():
    window = WindowBlocks(num_blocks=6, num_logical=32, window=8, block_size=4)
    kv = KVCacheManager(32, 4, window=window)
    req = _request(list(range(40)))
    assert kv.allocate(req, 40) is False  # ten blocks: the window pool has six
    assert kv.allocate(req, 24)
    req.num_computed_tokens = 24
    kv.slide(req)  # queries from 24 on see 17..: blocks 4 and 5
    assert req.window_start == 4 and window.num_used == 2
    assert list(window.remap[req.block_ids[:4]]) == [window.null] * 4
    assert kv.allocate(req, 40) and window.num_used == 6
    kv.trim(req, 29)  # a rollback: blocks 8 and 9 go, in both pools
    assert len(req.block_ids) == 8 and window.num_used == 4
    kv.release(req)
    assert window.num_free == 6 and kv.num_free_blocks == 32


def test_a_prefix_hit_needs_its_window_still_held():
    window = WindowBlocks(num_blocks=16, num_logical=32, window=8, block_size=4)
    kv = KVCacheManager(32, 4, window=window)
    first = _request(list(range(24)))
    assert kv.allocate(first, 24)
    first.num_computed_tokens = 24
    kv.cache_full_blocks(first)
    kv.slide(first)
    second = _request(list(range(24)) + [99])
    assert kv.acquire_prefix(second) == 24  # blocks 4 and 5, which its window needs, are held
    assert second.window_start == 4 and window.refs[first.block_ids[5]] == 2
    for req in (first, second):  # both windows leave blocks 4 and 5 behind
        req.num_computed_tokens = 33
        assert kv.allocate(req, 33)
        kv.slide(req)
    third = _request(list(range(24)) + [98])
    assert kv.acquire_prefix(third) == 0  # the full layers' blocks alone do not make a hit
    kv.release(first)
    kv.release(second)
    assert window.num_free == 16 and kv.num_free_blocks == 32


def _advance(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """Allocate, compute and cache up to `num_tokens`, then slide (a step's bookkeeping)."""
    assert kv.allocate(req, num_tokens)
    req.num_computed_tokens = num_tokens
    kv.cache_full_blocks(req)
    kv.slide(req)


def test_an_ended_request_leaves_its_window_to_the_prefix_cache():
    window = WindowBlocks(num_blocks=4, num_logical=32, window=8, block_size=4)
    kv = KVCacheManager(32, 4, window=window)
    first = _request(list(range(18)))
    for n in (12, 16, 18):
        _advance(kv, first, n)
    assert first.window_start == 2  # behind its last full block's end (16), not 18
    full = first.block_ids[2:4]
    kv.release(first)
    assert list(window.kept) == full  # its cached full blocks; not the partial one
    assert window.num_free == 4 and window.evictable == 2
    turn = _request(list(range(18)) + [99])
    assert kv.acquire_prefix(turn) == 16 and window.num_free == 2
    kv.release(turn)
    other = _request(list(range(100, 116)))
    assert kv.allocate(other, 16)  # takes the kept blocks back
    assert not window.kept and window.num_free == 0
    kv.release(other)
    assert window.num_free == 4


@pytest.mark.parametrize("model", ["gemma3_dir", "gpt_oss_dir"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 8},
        {"num_kv_blocks": 24},  # fewer than the requests need together: preemption
        {"speculative": {"method": "ngram", "num_tokens": 4, "max_batch": None}},
    ],
    ids=["whole", "chunked", "preempted", "ngram"],
)
def test_greedy_tokens_match_transformers(request, model, options):
    path = request.getfixturevalue(model)
    hf = hf_model(path)
    prompts = [p + p[:12] for p in random_prompts(4, 20, 40, seed=11)]
    params = SamplingParams(max_tokens=30, **GREEDY)
    llm = LLM(str(path), **WINDOWED, **options)
    kv = llm.engine.kv
    assert kv.window is not None and kv.window.num_blocks <= kv.num_blocks
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 30) for p in prompts]
    if "num_kv_blocks" in options:
        assert any(o.metrics["num_preemptions"] for o in outputs)
    # next turns: each extends a finished request, whose window the prefix cache kept
    turns = [p + o.token_ids + [7] for p, o in zip(prompts, outputs, strict=True)]
    again = llm.generate(turns, SamplingParams(max_tokens=6, **GREEDY))
    assert [o.token_ids for o in again] == [hf_greedy(hf, p, 6) for p in turns]
    assert any(o.num_cached_tokens for o in again) or "num_kv_blocks" in options  # evicted
    assert kv.window.num_free == kv.window.num_blocks and kv.num_free_blocks == kv.num_blocks


def _held(req: Request) -> int:
    return len(req.block_ids) - req.window_start


def test_a_long_request_holds_its_window_only(gemma3_dir):  # noqa: F811
    """Between steps each request holds at most window / block_size + 1 window blocks while
    its logical table grows; a prefix is served while another request's window holds its end,
    and not once every window has moved past it."""
    engine = LLM(str(gemma3_dir), **WINDOWED).engine
    window = engine.kv.window
    prompt = random_prompts(1, 40, 41, seed=12)[0]
    params = SamplingParams(max_tokens=40, **GREEDY)
    first = engine.add_request(prompt, params)
    engine.step()
    second = engine.add_request(prompt + [5, 6, 7], params)
    engine.step()
    assert second.num_cached_tokens == 40
    for _ in range(20):
        engine.step()
        assert _held(first) <= BOUND and _held(second) <= BOUND
        assert window.num_used <= 2 * BOUND
    assert len(first.block_ids) >= 15  # its whole context, in the full layers' pool
    third = engine.add_request(prompt + [8, 9], params)
    while engine.has_unfinished():
        engine.step()
        assert all(_held(r) <= BOUND for r in (first, second, third) if r.block_ids)
    assert third.num_cached_tokens == 0
    turn = engine.add_request(first.token_ids + [5], SamplingParams(max_tokens=8, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert turn.num_cached_tokens == (len(first.token_ids) - 1) // 4 * 4  # its computed blocks
    hf = hf_model(gemma3_dir)
    for req in (first, second, third, turn):
        n = req.num_prompt_tokens
        assert req.token_ids[n:] == hf_greedy(hf, req.token_ids[:n], req.max_tokens)
    assert window.num_free == window.num_blocks


def test_the_full_layers_get_the_memory_the_window_layers_free(gemma3_dir):  # noqa: F811
    """One full layer in seven: the same memory holds several times the context."""
    cfg = ModelConfig.from_dir(gemma3_dir)
    config = EngineConfig(model=str(gemma3_dir), kv_cache_memory_gb=0.01, block_size=4)
    pooled = size_kv_cache(config, cfg, torch.float32, 10**6)
    every = size_kv_cache(replace(config, tensor_parallel_size=2), cfg, torch.float32, 10**6)
    assert every.window_blocks == 0 and pooled.window_blocks > 0
    per_layer = every.bytes_per_token * 4 // cfg.num_layers
    used = pooled.num_blocks + 6 * pooled.window_blocks
    assert used * per_layer <= 0.01 * 2**30 < (used + 7) * per_layer
    assert pooled.max_model_len >= 3 * every.max_model_len


def test_perplexity_reads_the_window_layers_through_the_map(gemma3_dir):  # noqa: F811
    llm = LLM(str(gemma3_dir), **WINDOWED)
    text = (gemma3_dir / "tokenizer.json").read_text()[:3000]
    result = perplexity(llm, text, max_tokens=200, window=64, chunk=24)
    ids = llm.tokenizer.encode(text, False)[:201]
    model = hf_model(gemma3_dir)
    assert result["tokens"] == 200
    expected = reference_perplexity(model, ids, 200, 64)
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert llm.engine.kv.window.num_free == llm.engine.kv.window.num_blocks
