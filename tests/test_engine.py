"""Engine behaviour: preemption under KV pressure, sampling options, stops, bad input."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.errors import ContextLengthExceeded, InvalidRequestError, ModelLoadError
from expresslane.kernels import cpu_kernels

from .conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32")


def test_stress_small_kv_pool_preempts_and_matches_solo(llama_dir, llm):
    rng = random.Random(0)
    prompts = random_prompts(200, 4, 90, seed=7)
    params = [SamplingParams(max_tokens=rng.randint(4, 40), **GREEDY) for _ in prompts]
    # 32 blocks of 16 tokens: a few requests at a time, far from all 200
    small = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, max_batch=64)
    outs = small.generate(prompts, params)
    solo = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in outs] == solo
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0  # the pool really was too small
    kv = small.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.blocks)
    assert not small.engine.requests


def test_bf16_greedy_tokens_do_not_depend_on_the_batch(llama_bf16_dir):
    """With bf16 weights on a CPU with AVX-512 BF16 every step runs the native kernels, whose
    rows are computed alike whatever else is in the step: a prompt's greedy tokens are the
    same decoded alone as in a batch of 32, with its prompt cut into chunks beside other
    sequences' decodes, and after a prefix that another request left in the cache."""
    alone_llm = LLM(str(llama_bf16_dir), max_batch=1, enable_prefix_caching=False)
    if not alone_llm.engine.model.plan.every_step:
        pytest.skip("row-invariant steps need the AVX-512 BF16 kernels")
    prompts = random_prompts(40, 4, 90, seed=9)
    prompts += [prompts[0][:48] + p for p in prompts[1:9]]  # the first prompt's prefix, cached
    params = SamplingParams(max_tokens=24, **GREEDY)
    alone = [alone_llm.generate(p, params)[0].token_ids for p in prompts]
    batched = LLM(str(llama_bf16_dir), max_batch=32, max_num_batched_tokens=40)
    outs = batched.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert sum(o.num_cached_tokens for o in outs) >= 8 * 32  # prefix hits happened


def test_bf16_preempted_requests_recompute_the_same_tokens(llama_bf16_dir):
    """A preempted request recomputes its prompt and output as prompt chunks, beside other
    requests' decodes in the native step: its tokens still match a solo run (with bf16 weights
    rows are computed alike in any step, so nothing may differ)."""
    solo_llm = LLM(str(llama_bf16_dir), max_batch=1, enable_prefix_caching=False)
    if not solo_llm.engine.model.plan.every_step:
        pytest.skip("row-invariant steps need the AVX-512 BF16 kernels")
    rng = random.Random(1)
    prompts = random_prompts(60, 4, 90, seed=8)
    params = [SamplingParams(max_tokens=rng.randint(8, 40), **GREEDY) for _ in prompts]
    small = LLM(str(llama_bf16_dir), num_kv_blocks=24, max_batch=32)
    outs = small.generate(prompts, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    solo = [solo_llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in outs] == solo


def test_batch_invariant_is_kept_or_refused(llama_dir, llama_bf16_dir):
    """`batch_invariant=True`: bf16 weights with the CPU kernels run every step in the layer
    stack; float32 weights (oneDNN matmuls, no row kernel) are refused at load, the message
    naming the plan."""
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    assert LLM(str(llama_bf16_dir), batch_invariant=True).engine.model.plan.every_step
    with pytest.raises(InvalidRequestError, match="batch_invariant needs .* linears"):
        LLM(str(llama_dir), dtype="float32", batch_invariant=True)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = random_prompts(1, 10, 11, seed=3)[0]
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(p, sp)[0].token_ids
    others = random_prompts(5, 5, 40, seed=4)
    mixed = llm.generate(others + [p], [SamplingParams(max_tokens=30, temperature=0.8)] * 5 + [sp])
    assert mixed[-1].token_ids == alone
    different = llm.generate(
        p, SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert different[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    p = random_prompts(1, 12, 13, seed=5)[0]
    greedy = llm.generate(p, SamplingParams(max_tokens=16, **GREEDY))[0].token_ids
    k1 = llm.generate(
        p, SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=1, ignore_eos=True)
    )
    p_small = llm.generate(
        p, SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=1, ignore_eos=True)
    )
    assert k1[0].token_ids == greedy
    assert p_small[0].token_ids == greedy


def test_top_k_restricts_the_choice(llm):
    p = random_prompts(1, 12, 13, seed=6)[0]
    logits = llm.generate(p, SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0].logprobs[0]
    top3 = {tid for tid, _ in logits["top"][:3]}
    picks = {
        llm.generate(p, SamplingParams(max_tokens=1, temperature=5.0, top_k=3, seed=s))[
            0
        ].token_ids[0]
        for s in range(40)
    }
    assert picks <= top3 and len(picks) > 1


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    p = random_prompts(1, 8, 9, seed=8)[0]
    free = llm.generate(p, SamplingParams(max_tokens=20, **GREEDY))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    late = llm.generate(
        p,
        SamplingParams(
            max_tokens=20, temperature=0, stop_token_ids=[stop_at], min_tokens=first + 2
        ),
    )[0]
    assert len(late.token_ids) >= first + 2


def test_stop_strings_are_cut_from_the_text(llm):
    free = llm.generate("def main(", SamplingParams(max_tokens=30, **GREEDY))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = llm.generate("def main(", SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]


def test_logprobs_are_log_softmax_of_the_model(llm):
    out = llm.generate(
        [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    )[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp["top"][0][0] == tok and lp["token"] == pytest.approx(lp["top"][0][1])
        assert lp["token"] <= 0


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and e.value.status == 400


def test_prompt_too_long_and_max_tokens_too_large(llm):
    n = llm.engine.max_model_len
    with pytest.raises(ContextLengthExceeded) as e:
        llm.generate([1] * (n + 5), SamplingParams(max_tokens=4))
    assert e.value.code == "context_length_exceeded" and str(n) in e.value.message
    with pytest.raises(ContextLengthExceeded):
        llm.generate([1] * 10, SamplingParams(max_tokens=n))
    with pytest.raises(InvalidRequestError):
        llm.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequestError):
        llm.generate([10**6], SamplingParams())
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_unknown_architecture_and_missing_weights(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(bad))
    empty = tmp_path / "noweights"
    shutil.copytree(llama_dir, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(empty))
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    shutil.copy(llama_dir / "tokenizer.json", tmp_path / "sharded")
    p = random_prompts(1, 10, 11)[0]
    ref = LLM(str(llama_dir), dtype="float32").generate(p, SamplingParams(max_tokens=8, **GREEDY))
    got = LLM(str(tmp_path / "sharded"), dtype="float32").generate(
        p, SamplingParams(max_tokens=8, **GREEDY)
    )
    assert got[0].token_ids == ref[0].token_ids


def test_a_request_that_waited_too_long_to_start_fails_with_queue_timeout(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_queue_seconds=30.0)
    engine = llm.engine
    old = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    fresh = engine.add_request([5, 6, 8], SamplingParams(max_tokens=4, **GREEDY))
    old.metrics.queued -= 31.0  # as if it had waited in an overloaded queue
    outputs = {o.request_id: o for _ in range(20) for o in engine.step() if o.finished}
    assert outputs[old.request_id].finish_reason == "error"
    assert outputs[old.request_id].error.startswith("queue_timeout")
    assert outputs[fresh.request_id].finish_reason == "length"
    assert engine.kv.num_used_blocks == 0 and not engine.requests


def test_a_preempted_request_that_waits_too_long_to_resume_fails_with_queue_timeout(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_queue_seconds=30.0)
    engine = llm.engine
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))
    engine.step()
    engine.scheduler._preempt(req)  # back in the queue, with output so far
    assert req.metrics.first_scheduled is not None and req.status.value == "waiting"
    req.metrics.queued -= 31.0
    outputs = [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == [req.request_id]
    assert outputs[0].finish_reason == "error" and "queue_timeout" in outputs[0].error
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing leaked
