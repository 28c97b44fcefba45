"""Tensor parallelism (engine/parallel/): the model split over gloo ranks in worker processes
gives the greedy tokens of one process, and a rank that dies fails steps instead of hanging."""

from __future__ import annotations

import logging
import multiprocessing
import os

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig
from expresslane.engine.engine import LLMEngine
from expresslane.engine.parallel.affinity import rank_cores
from expresslane.errors import InvalidRequestError, ModelLoadError
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.models.config import ModelConfig
from expresslane.models.shard import Shard

from .conftest import ARCH_CONFIGS, make_checkpoint, random_biases, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_orphans():
    """Every test leaves no worker process behind."""
    before = set(multiprocessing.active_children())
    yield
    assert set(multiprocessing.active_children()) <= before


def generate(path, prompts, params=GREEDY, passes: int = 1, **options):
    """Token ids of each pass's outputs (the same prompts again: from the prefix cache), and
    the outputs of the last, from a fresh `LLM` closed after."""
    llm = LLM(path and str(path), dtype="float32", **options)
    try:
        runs = [llm.generate(prompts, params) for _ in range(passes)]
    finally:
        llm.close()
    return [[o.token_ids for o in run] for run in runs], runs[-1]


def mixed_prompts(seed: int = 1) -> list[list[int]]:
    prompts = random_prompts(8, 3, 60, seed=seed)
    prompts[3] = prompts[0][:20] + prompts[3]  # a shared prefix for the prefix cache
    return prompts


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_tokens_at_size_2_are_those_of_size_1(checkpoints, arch):
    """Mixed lengths, prompts chunked beside decodes, then all again from the prefix cache."""
    prompts = mixed_prompts()
    options = {"max_num_batched_tokens": 32}
    one, _ = generate(checkpoints[arch], prompts, **options)
    two, _ = generate(checkpoints[arch], prompts, passes=2, tensor_parallel_size=2, **options)
    assert two == one * 2


def prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of `prompt`, prefilled in one chunk into a fresh engine."""
    T = len(prompt)
    chunk = PrefillChunk(0, T, T, None, T)
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[chunk])
    return engine.model(torch.tensor(prompt), torch.arange(T), meta)


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_logits_at_size_2_are_those_of_size_1(checkpoints, arch):
    """Float32 sums of other orders (each rank's part of a row, then the all-reduce)."""
    prompt = random_prompts(1, 80, 81, seed=7)[0]
    engines = [tp_engine(checkpoints[arch], size) for size in (1, 2)]
    try:
        one, two = (prefill_logits(e, prompt) for e in engines)
    finally:
        for e in engines:
            e.close()
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_an_output_projection_bias_is_added_once(tmp_path, quantization, monkeypatch):
    """Llama with `attention_bias`: o_proj's bias on rank 0 alone under the all-reduce, split
    by rows where FP4 gathers the projection."""
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", "rows")
    path = random_biases(make_checkpoint(tmp_path, "llama", attention_bias=True), "o_proj.bias")
    prompts = mixed_prompts(seed=4)[:4]
    one, _ = generate(path, prompts, quantization=quantization)
    two, _ = generate(path, prompts, quantization=quantization, tensor_parallel_size=2)
    assert two == one


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe", "mixtral"])
def test_gemma3_and_mixtures_of_experts_at_size_2(tmp_path, arch):
    """Gemma 3: sliding-window layers with their own RoPE, sandwich norms, scaled
    embeddings. Mixtures of experts: every expert's columns split, the router whole."""
    path = make_checkpoint(tmp_path, arch)
    prompts = mixed_prompts(seed=3)[:4]
    one, _ = generate(path, prompts)
    two, _ = generate(path, prompts, tensor_parallel_size=2)
    assert two == one


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_ngram_speculation_at_size_2(checkpoints, arch):
    path = checkpoints[arch]
    prompts = [p + p[:12] for p in random_prompts(6, 10, 40, seed=21)]
    spec = {"method": "ngram", "num_tokens": 4, "max_batch": None}
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, speculative=spec)
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.engine.speculation.stats
    finally:
        llm.close()
    plain, _ = generate(path, prompts)
    assert tokens == plain[0]
    assert stats.proposed > 0 and stats.accepted > 0


def test_draft_speculation_at_size_2():
    """The bundled demo model (float32: no C++ layer stack at size 1 either) and its draft,
    which runs on rank 0 alone."""
    prompts = ["The quick brown fox", "Once upon a time, there was", "def add(a, b):"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = {"method": "draft", "num_tokens": 4, "max_batch": None}
    llm = LLM(None, dtype="float32", tensor_parallel_size=2, speculative=spec)
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.speculation.stats
    finally:
        llm.close()
    plain, _ = generate(None, prompts, params)
    assert tokens == plain[0]
    assert stats.accepted > 0


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_compressed_kv_at_size_2(llama_dir, kv):
    prompts = mixed_prompts(seed=5)[:4]
    one, _ = generate(llama_dir, prompts, kv_cache_dtype=kv)
    two, _ = generate(llama_dir, prompts, kv_cache_dtype=kv, tensor_parallel_size=2)
    assert two == one


@pytest.mark.parametrize("arch, fmt", [("llama", "mxfp4"), ("qwen2", "nvfp4"), ("qwen3", "mxfp4")])
def test_fp4_greedy_tokens_at_size_2(checkpoints, arch, fmt, monkeypatch):
    """FP4 output projections split by their output rows, input and output gathered: every
    output is computed as one process computes it, so the tokens and their logprobs are
    those of size 1 (partial sums all-reduced in another order would move the next linear's
    int8 activation rounding). The prompt linears stay in the FP4 kernel at size 1 too
    (oneDNN's bf16 matmul serves them in the C++ layer stack only)."""
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", "rows")
    prompts = mixed_prompts(seed=2)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    _, one = generate(checkpoints[arch], prompts, params, quantization=fmt)
    _, two = generate(checkpoints[arch], prompts, params, quantization=fmt, tensor_parallel_size=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    drift = [
        abs(a["token"] - b["token"])
        for x, y in zip(one, two, strict=True)
        for a, b in zip(x.logprobs, y.logprobs, strict=True)
    ]
    assert max(drift) < 1e-4  # the attention's and the head's float32 shapes differ per rank


def test_kv_heads_replicated_past_their_number(llama_dir):
    """Four ranks over the model's two KV heads: each pair of ranks shares one."""
    assert ModelConfig.from_dir(llama_dir).num_kv_heads == 2
    prompts = random_prompts(3, 5, 30, seed=4)
    one, _ = generate(llama_dir, prompts)
    four, _ = generate(llama_dir, prompts, tensor_parallel_size=4)
    assert four == one


def test_shards_split_heads_columns_and_vocabulary(llama_dir):
    cfg = ModelConfig.from_dir(llama_dir)
    parts = [Shard(r, 2).config(cfg) for r in range(2)]
    assert {(p.num_heads, p.num_kv_heads, p.intermediate_size) for p in parts} == {(2, 1, 64)}
    vocab = [(0, 16, 16), (16, 32, 16), (32, 40, 16)]  # (first, end, rows padded)
    assert [Shard(r, 3).vocab_rows(40) for r in range(3)] == vocab
    assert rank_cores(1, 2, [0, 1, 2, 3, 4]) == [3, 4] and rank_cores(1, 4, [0, 1]) == [0, 1]
    with pytest.raises(Exception, match="does not divide"):
        Shard(0, 3).check(cfg)
    with pytest.raises(InvalidRequestError, match="cuda_graphs"):
        LLMEngine(EngineConfig(model=str(llama_dir), tensor_parallel_size=2, cuda_graphs=True))


def test_a_model_that_does_not_split_fails_to_load_cleanly(llama_dir):
    """Three ranks for four heads: the load fails in one line, and no worker is left."""
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 does not divide"):
        LLM(str(llama_dir), dtype="float32", tensor_parallel_size=3)


def run_to_end(engine: LLMEngine, prompts) -> list:
    """The final output of each request (the engine stepped until none is left)."""
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    last = {}
    while engine.has_unfinished():
        last.update((o.request_id, o) for o in engine.step())
    return [last[r.request_id] for r in reqs]


def tp_engine(path, size: int = 2) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=size))


def test_a_dead_rank_fails_the_steps_that_follow(llama_dir, caplog):
    engine = tp_engine(llama_dir)
    try:
        prompts = random_prompts(3, 5, 20, seed=3)
        assert all(o.finish_reason == "length" for o in run_to_end(engine, prompts))
        worker = engine.parallel.processes[0]
        worker.kill()
        worker.join()
        with caplog.at_level(logging.ERROR, logger="expresslane.engine"):
            for _ in range(2):  # the next requests fail at once too
                outs = run_to_end(engine, prompts)
                assert {o.finish_reason for o in outs} == {"error"}
                assert all("tensor-parallel rank 1" in o.error for o in outs)
        assert "tensor parallelism broke" in caplog.text
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        engine.close()


def test_a_rank_dying_inside_a_step_fails_it(llama_dir):
    """The worker dies while rank 0 runs the forward pass: its next all-reduce fails."""
    engine = tp_engine(llama_dir)
    try:
        worker = engine.parallel.processes[0]

        def kill(module, args):
            worker.kill()
            worker.join()

        engine.model.register_forward_pre_hook(kill)  # after the group's: the step was sent
        outs = run_to_end(engine, random_prompts(2, 5, 20, seed=3))
        assert {o.finish_reason for o in outs} == {"error"}
        assert all("tensor parallelism broke" in o.error for o in outs)
    finally:
        engine.close()


def test_close_stops_the_workers(llama_dir):
    threads = torch.get_num_threads()
    engine = tp_engine(llama_dir)
    processes = engine.parallel.processes
    engine.close()
    engine.close()
    assert not any(p.is_alive() for p in processes)
    assert all(p.exitcode == 0 for p in processes)  # told to stop, not killed
    assert torch.get_num_threads() == threads


def test_the_ranks_sockets_listen_on_loopback_only(llama_dir):
    """Neither gloo's sockets nor the rendezvous store take authentication: none may listen
    on a public interface (the store listened on `::`; gloo binds what the host name resolves
    to, loopback on this machine)."""
    import psutil

    engine = tp_engine(llama_dir)
    try:
        pids = [os.getpid()] + [p.pid for p in engine.parallel.processes]
        listening = [
            c.laddr.ip
            for pid in pids
            for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening
    finally:
        engine.close()
