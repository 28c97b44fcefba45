"""Parity with transformers on random-weight Llama, Qwen2 and Qwen3 checkpoints (float32)."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.kernels import cpu_kernels
from expresslane.models import load_model
from expresslane.models.attention import AttentionMetadata, PrefillChunk

from .conftest import ARCH_CONFIGS, bf16_copy, make_checkpoint, random_biases, random_prompts

transformers = pytest.importorskip("transformers")


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def prefill_logits(path, T: int, seed: int = 0):
    """(our model, its config, our logits, transformers' logits) of one T-token random prompt
    prefilled in one piece, float32 on CPU."""
    model, cfg = load_model(path, torch.float32, torch.device("cpu"), 512)
    shape = (2, cfg.num_kv_heads, 512, cfg.head_dim)
    model.bind_kv_cache([torch.zeros(shape) for _ in model.layers])
    ids = torch.tensor(random_prompts(1, T, T + 1, seed=seed)[0])
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)])
    ours = model(ids, torch.arange(T), meta)
    with torch.no_grad():
        ref = hf_model(path)(ids[None]).logits[0]
    return model, cfg, ours, ref


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_prefill_logits_match_transformers(checkpoints, arch):
    _, _, ours, ref = prefill_logits(checkpoints[arch], 100)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16},  # chunked prefill: prompts split over steps
    ],
    ids=["prefix-cache", "no-prefix-cache", "chunked"],
)
def test_greedy_matches_transformers(checkpoints, arch, options):
    path = checkpoints[arch]
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", **options)
    prompts = random_prompts(8, 3, 60, seed=1)
    prompts[3] = prompts[0][:20] + prompts[3]  # a shared prefix for the prefix cache
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    refs = [hf_greedy(hf, p, 64) for p in prompts]
    single = llm.generate(prompts[0], params)[0]
    assert single.token_ids == refs[0]
    batch = llm.generate(prompts, params)
    assert [o.token_ids for o in batch] == refs
    again = llm.generate(prompts, params)  # second pass: prompts now hit the prefix cache
    assert [o.token_ids for o in again] == refs
    if options.get("enable_prefix_caching", True):
        assert all(o.num_cached_tokens >= 16 for o, p in zip(again, prompts) if len(p) > 16)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_bf16_checkpoint_auto_dtype_matches_float32(tmp_path, checkpoints, arch):
    """On CPU, dtype="auto" may keep bf16 linear weights for the small-batch kernels (and the
    C++ decode step); the result must equal float32 compute over the same bf16 weights."""
    bf16_copy(checkpoints[arch], tmp_path / "bf16")
    prompts = random_prompts(4, 5, 40, seed=11)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    auto = LLM(str(tmp_path / "bf16"), max_batch=3)  # batches of 3, then 1: mixed lengths
    fp32 = LLM(str(tmp_path / "bf16"), dtype="float32")
    if cpu_kernels() is not None:
        assert auto.engine.model.layer_stack is not None
    got = auto.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in fp32.generate(prompts, params)]


def test_an_output_projection_bias_keeps_the_python_layers(tmp_path):
    """Llama's `attention_bias` gives o_proj a bias, which the C++ layer stack does not add:
    the stack is declined, and the bf16 model's tokens are float32 compute's."""
    path = random_biases(make_checkpoint(tmp_path, "llama", attention_bias=True), ".bias")
    bf16_copy(path, tmp_path / "bf16")
    prompts = random_prompts(4, 5, 40, seed=12)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    auto = LLM(str(tmp_path / "bf16"))
    fp32 = LLM(str(tmp_path / "bf16"), dtype="float32")
    assert auto.engine.model.layer_stack is None
    got = auto.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in fp32.generate(prompts, params)]
    _, _, ours, ref = prefill_logits(path, 60)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
