"""Mixtures of experts (models/moe.py) against transformers on random Qwen3-MoE and Mixtral
checkpoints, and what a step computes: only the routed experts, one call per expert."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.errors import ModelLoadError
from expresslane.models.moe import SparseMoE

from .conftest import MOE_CONFIGS, make_checkpoint, random_prompts
from .test_model_parity import hf_greedy, hf_model, prefill_logits

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_checkpoint(root, arch) for arch in MOE_CONFIGS}


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_prefill_logits_match_transformers(moe_checkpoints, arch):
    model, cfg, ours, ref = prefill_logits(moe_checkpoints[arch], 80, seed=3)
    assert cfg.moe is not None and any(layer.moe is not None for layer in model.layers)
    if arch == "qwen3moe":
        assert model.layers[1].moe is None  # mlp_only_layers: a dense layer
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_greedy_matches_transformers(moe_checkpoints, arch):
    path = moe_checkpoints[arch]
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32")
    prompts = random_prompts(6, 3, 50, seed=2)
    prompts[2] = prompts[0][:20] + prompts[2]  # a shared prefix for the prefix cache
    params = SamplingParams(max_tokens=24, **GREEDY)
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs  # prefix cache hits
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_a_step_calls_each_routed_expert_once_and_no_other(moe_checkpoints, monkeypatch):
    llm = LLM(str(moe_checkpoints["qwen3moe"]), dtype="float32")
    calls: list[tuple[int, int, int]] = []  # (layer, expert, rows)
    expert = SparseMoE.expert

    def spy(self, e, x):
        calls.append((id(self), e, x.shape[0]))
        return expert(self, e, x)

    monkeypatch.setattr(SparseMoE, "expert", spy)
    prompts = random_prompts(4, 10, 20, seed=5)
    reqs = [llm.engine.add_request(p, SamplingParams(max_tokens=3, **GREEDY)) for p in prompts]
    llm.engine.step()  # the prompts: 4 x 10-20 tokens, two choices each
    sparse_layers = 2
    assert len({(layer, e) for layer, e, _ in calls}) == len(calls)  # once per expert
    assert sum(rows for *_, rows in calls) == 2 * sum(map(len, prompts)) * sparse_layers
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert all(r.num_output_tokens == 3 for r in reqs)
    single = llm.engine.add_request(prompts[0], SamplingParams(max_tokens=2, **GREEDY))
    llm.engine.step()  # its prompt and first token
    calls.clear()
    llm.engine.step()  # a batch-1 decode: its top_k = 2 experts per sparse layer, a row each
    assert single.num_output_tokens == 2
    assert len(calls) == 2 * sparse_layers and all(rows == 1 for *_, rows in calls)


def test_fp4_weights_are_refused_for_experts(moe_checkpoints):
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        LLM(str(moe_checkpoints["mixtral"]), dtype="float32", quantization="nvfp4")
