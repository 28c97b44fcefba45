"""Gemma 3 (text) against transformers on a random checkpoint: sliding-window layers with their
own RoPE base beside a global one, (1 + weight) norms around attention and the MLP, scaled
embeddings, gelu-tanh and another query scale. Prompts longer than the window, in one piece,
in chunks and over the prefix cache."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams

from .conftest import make_checkpoint, random_prompts
from .test_model_parity import hf_greedy, hf_model, prefill_logits

transformers = pytest.importorskip("transformers")
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """The random checkpoint with its norm weights drawn too (transformers starts them at 0,
    where (1 + weight) and weight alone would both pass)."""
    path = make_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


def test_prefill_logits_match_transformers(gemma3_dir):
    model, cfg, ours, ref = prefill_logits(gemma3_dir, 40, seed=4)
    assert cfg.layer_windows == [8, 8, 8, 8, 8, None, 8]
    assert model.layer_stack is None  # the C++ stack runs Llama blocks only
    torch.testing.assert_close(ours, ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 16}],  # chunked: later chunks read the cache in a window
    ids=["whole", "chunked"],
)
def test_greedy_matches_transformers(gemma3_dir, options):
    hf = hf_model(gemma3_dir)
    llm = LLM(str(gemma3_dir), dtype="float32", **options)
    prompts = random_prompts(6, 3, 50, seed=8)
    prompts[2] = prompts[0][:24] + prompts[2]  # a shared prefix for the prefix cache
    params = SamplingParams(max_tokens=24, **GREEDY)
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs  # prefix cache hits
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_speculation_keeps_greedy_tokens(gemma3_dir):
    base = random_prompts(4, 10, 30, seed=9)
    prompts = [p + p[:12] for p in base]
    params = SamplingParams(max_tokens=32, **GREEDY)
    plain = LLM(str(gemma3_dir), dtype="float32").generate(prompts, params)
    spec = LLM(
        str(gemma3_dir),
        dtype="float32",
        speculative={"method": "ngram", "num_tokens": 4, "max_batch": None},
    ).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
