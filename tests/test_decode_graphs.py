"""Decode graphs (engine/decode_graphs.py) on a CPU, where the eager-replay backend runs the
captured callable on the static buffers: bucketing, padding and replay bookkeeping are those
of CUDA graphs, and greedy tokens are the eager engine's."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.engine import decode_graphs
from expresslane.engine.decode_graphs import (
    DecodeGraphs,
    batch_buckets,
    context_buckets,
    smallest_at_least,
)
from expresslane.models import attention

from .conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(params=["native", "torch"])
def decode_attention(request, monkeypatch):
    """Decode attention in the C++ kernel (the CPU's path), or in PyTorch (the path a GPU
    captures), whatever this CPU has."""
    if request.param == "torch":
        monkeypatch.setattr(attention, "native_decode_attention", lambda q, kv: None)
    return request.param


def test_batch_buckets_and_their_edges():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    buckets = batch_buckets(64)
    assert smallest_at_least(buckets, 1) == 1
    assert smallest_at_least(buckets, 3) == 4
    assert smallest_at_least(buckets, 16) == 16  # a bucket exactly
    assert smallest_at_least(buckets, 17) == 24  # one over
    assert smallest_at_least(buckets, 64) == 64
    assert smallest_at_least(buckets, 65) is None  # above the largest: eager


def test_context_buckets_round_up_to_powers_of_two_capped_at_the_positions():
    assert context_buckets(512) == [64, 128, 256, 512]
    assert context_buckets(300) == [64, 128, 256, 300]
    assert context_buckets(64) == [64]
    assert context_buckets(40) == [40]
    graphs = DecodeGraphs(SimpleNamespace(device=torch.device("cpu")), 64, 300, pad_slot=0)
    assert graphs.key(1, 1) == (1, 64)
    assert graphs.key(5, 64) == (8, 64)
    assert graphs.key(9, 65) == (16, 128)
    assert graphs.key(64, 300) == (64, 300)
    assert graphs.key(65, 10) is None
    assert graphs.key(3, 301) is None


def _decoding_batch(llm: LLM, prompts: list[list[int]]):
    """Prefill `prompts` through the engine (eagerly); then schedule (blocks allocated) the
    first step in which every request decodes, and return its items."""
    engine = llm.engine
    graphs, engine.runner.graphs = engine.runner.graphs, None
    params = SamplingParams(max_tokens=50, **GREEDY)
    reqs = [engine.add_request(p, params) for p in prompts]
    while not all(r.num_computed_tokens == r.num_tokens - 1 for r in reqs):
        engine.step()
    engine.runner.graphs = graphs
    items = engine.scheduler.schedule().items
    assert sorted(id(r) for r, _ in items) == sorted(id(r) for r in reqs)
    assert all(n == 1 and not r.spec.guesses for r, n in items)
    return items


def _kv(runner) -> list[torch.Tensor]:
    return [c.tensor.clone() for c in runner.kv_caches]


def _restore(runner, saved: list[torch.Tensor]) -> None:
    for c, t in zip(runner.kv_caches, saved, strict=True):
        c.tensor.copy_(t)


@pytest.fixture
def graphs_llm(llama_dir, decode_attention):
    return LLM(str(llama_dir), dtype="float32", cuda_graphs=True, max_batch=16)


def test_padded_replay_writes_no_real_sequences_kv(graphs_llm):
    """A decode step of 5 sequences replayed padded to 8 rows and 128 positions writes the
    same K/V at the real sequences' slots as the eager step, samples the same tokens, and
    changes no other slot but the pad block's."""
    runner = graphs_llm.engine.runner
    items = _decoding_batch(graphs_llm, random_prompts(5, 40, 100, seed=3))
    graphs = runner.graphs
    before = _kv(runner)
    runner.graphs = None
    eager_samples, eager = runner.step(items)
    eager_kv = _kv(runner)
    _restore(runner, before)
    runner.graphs = graphs
    samples, result = runner.step(items)
    assert graphs.stats.replays == 1 and list(graphs.graphs) == [(8, 128)]
    assert samples == eager_samples and result.token_ids == eager.token_ids
    pad = graphs.pad_slot
    written = torch.tensor(
        [runner.slots(r, r.num_computed_tokens, r.num_tokens)[0] for r, _ in items]
    )
    for old, ref, new in zip(before, eager_kv, _kv(runner), strict=True):
        assert new.shape[2] == pad + runner.block_size  # the pad block past the pool's
        torch.testing.assert_close(new[:, :, written], ref[:, :, written], rtol=1e-5, atol=1e-6)
        untouched = torch.ones(pad, dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(new[:, :, :pad][:, :, untouched], old[:, :, :pad][:, :, untouched])
        assert not torch.equal(new[:, :, pad:], old[:, :, pad:])  # padded rows wrote here


def test_one_capture_per_key_and_every_replay_counted(graphs_llm):
    runner = graphs_llm.engine.runner
    items = _decoding_batch(graphs_llm, random_prompts(4, 10, 40, seed=4))
    stats = runner.graphs.stats
    runner.step(items)
    runner.step(items)
    assert (stats.captures, stats.replays) == (1, 2)
    runner.step(items[:3])  # the same bucket: replayed, not captured
    assert (stats.captures, stats.replays) == (1, 3)
    runner.step(items[:1])  # a new key: captured once
    runner.step(items[:1])
    assert (stats.captures, stats.replays) == (2, 5)
    assert sorted(runner.graphs.graphs) == [(1, 64), (4, 64)]


def test_a_batch_above_the_largest_bucket_runs_eagerly(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", cuda_graphs=True, max_batch=2)
    runner = llm.engine.runner
    items = _decoding_batch(llm, random_prompts(2, 10, 40, seed=5))
    runner.step(items + items[:1])  # 3 rows, above max_batch: no graph
    assert runner.graphs.stats.eager == 1 and not runner.graphs.graphs


def test_a_failed_capture_leaves_every_step_eager(graphs_llm, monkeypatch):
    runner = graphs_llm.engine.runner
    items = _decoding_batch(graphs_llm, random_prompts(2, 10, 40, seed=7))
    graphs, runner.graphs = runner.graphs, None
    _, eager = runner.step(items)
    runner.graphs = graphs

    def fail(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs, "EagerReplay", fail)
    assert runner.step(items)[1].token_ids == eager.token_ids
    assert runner.step(items)[1].token_ids == eager.token_ids
    assert graphs.disabled and graphs.stats.eager == 2 and not graphs.graphs


def test_greedy_tokens_match_the_eager_engine(llama_dir, decode_attention):
    """Mixed prompt lengths and output lengths: decode batches shrink through several
    batch buckets and contexts grow through several context buckets; every token is the
    eager engine's, and every KV block comes back."""
    rng = random.Random(0)
    prompts = random_prompts(20, 4, 150, seed=11)
    params = [SamplingParams(max_tokens=rng.randint(2, 60), **GREEDY) for _ in prompts]
    eager = LLM(str(llama_dir), dtype="float32", max_batch=16)
    graphs = LLM(str(llama_dir), dtype="float32", max_batch=16, cuda_graphs=True)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphs.generate(prompts, params)] == expected
    dg = graphs.engine.runner.graphs
    assert len({b for b, _ in dg.graphs}) >= 3
    assert len({c for _, c in dg.graphs}) >= 2
    assert dg.stats.captures == len(dg.graphs) and dg.stats.replays > dg.stats.captures
    kv = graphs.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert eager.engine.runner.graphs is None


def test_steps_of_the_layer_stack_stay_eager(llama_bf16_dir):
    """Where the C++ layer stack runs a decode step (a CPU with the bf16 kernels) there is
    nothing to capture: those steps run as without graphs."""
    llm = LLM(str(llama_bf16_dir), cuda_graphs=True)
    if not llm.engine.model.plan.uses_stack(1, decode_only=True):
        pytest.skip("the layer stack needs the CPU kernels")
    llm.generate(random_prompts(3, 4, 20, seed=6), SamplingParams(max_tokens=4, **GREEDY))
    stats = llm.engine.runner.graphs.stats
    assert stats.replays == 0 and stats.eager > 0 and not llm.engine.runner.graphs.graphs
