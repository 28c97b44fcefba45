"""The engine on a CUDA device (benchmarks/gpu_check.sh runs these with test_fp4_triton.py):
parity with transformers in float32 and bf16 on random Llama, Qwen2, Qwen3 and
mixture-of-experts checkpoints, greedy identity with n-gram speculation and with CUDA graphs
(plain, FP8 and FP4 KV caches), the sampler against its definition, prefix caching. Skipped
without a CUDA device: the CPU paths have their own tests."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from expresslane import LLM, SamplingParams
from expresslane.engine.request import Request
from expresslane.engine.sampler import Sampler, filtered_probs
from expresslane.models import load_model
from expresslane.models.attention import AttentionMetadata, PrefillChunk

from .conftest import ARCH_CONFIGS, MOE_CONFIGS, bf16_copy, make_checkpoint, random_prompts
from .test_sampler import CASES, definition, settings, tied_logits

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
transformers = pytest.importorskip("transformers")
CUDA = torch.device("cuda")
GREEDY = dict(temperature=0, ignore_eos=True)


def hf_model(path, dtype: torch.dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(CUDA).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=CUDA),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def relative_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_prefill_logits_match_transformers(tmp_path, checkpoints, arch, dtype):
    path = checkpoints[arch]
    if dtype is torch.bfloat16:
        path = bf16_copy(path, tmp_path / "bf16")
    model, cfg = load_model(path, dtype, CUDA, 512)
    shape = (2, cfg.num_kv_heads, 512, cfg.head_dim)
    model.bind_kv_cache([torch.zeros(shape, dtype=dtype, device=CUDA) for _ in model.layers])
    T = 100
    ids = torch.tensor(random_prompts(1, T, T + 1)[0], device=CUDA)
    slots = torch.arange(T, device=CUDA)
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, T, T, None)])
    ours = model(ids, torch.arange(T, device=CUDA), meta)
    with torch.no_grad():
        ref = hf_model(path, dtype)(ids[None]).logits[0].float()
    # float32 against float32 kernels; bf16: each side rounds differently (about 0.4%)
    assert relative_l2(ours, ref) < (1e-4 if dtype is torch.float32 else 2e-2)


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_matches_transformers_and_the_prefix_cache(checkpoints, arch):
    path = checkpoints[arch]
    hf = hf_model(path, torch.float32)
    llm = LLM(str(path), dtype="float32", device="cuda")
    prompts = random_prompts(8, 3, 60, seed=1)
    prompts[3] = prompts[0][:20] + prompts[3]  # a shared prefix for the prefix cache
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    refs = [hf_greedy(hf, p, 32) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    again = llm.generate(prompts, params)  # the prompts now hit the prefix cache
    assert [o.token_ids for o in again] == refs
    assert all(o.num_cached_tokens >= 16 for o, p in zip(again, prompts) if len(p) > 16)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_bf16_greedy_tokens_do_not_depend_on_the_batch(tmp_path, checkpoints):
    path = bf16_copy(checkpoints["llama"], tmp_path / "bf16")
    llm = LLM(str(path), device="cuda")
    prompts = random_prompts(6, 5, 40, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    # bf16 kernels may pick other reduction orders per batch size: most rows agree in full
    same = sum(a == b for a, b in zip(alone, together))
    assert same >= len(prompts) - 1


def test_greedy_outputs_identical_with_ngram_speculation(llama_dir):
    base = random_prompts(8, 10, 40, seed=21)
    prompts = [p + p[:12] for p in base]  # the prompt repeats itself: n-grams to look up
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32", device="cuda").generate(prompts, params)
    spec_llm = LLM(
        str(llama_dir),
        dtype="float32",
        device="cuda",
        speculative={"method": "ngram", "num_tokens": 4, "max_batch": None},
    )
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.engine.speculation.stats.accepted > 0
    assert spec_llm.engine.kv.num_free_blocks == spec_llm.engine.kv.num_blocks


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_filtered_probs_follow_the_definition(case):
    rows = torch.stack([tied_logits(120, seed) for seed in range(4)])
    got = filtered_probs(rows.to(CUDA), *(t.to(CUDA) for t in settings([case] * 4))).cpu()
    for row, logits in zip(got, rows, strict=True):
        torch.testing.assert_close(row.double(), definition(logits, **case), atol=2e-6, rtol=1e-4)


def test_sampled_tokens_pass_a_chi_square_test():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8, top_p=0.95)
    want = filtered_probs(logits[None], *settings([dict(temperature=0.8, top_p=0.95)]))[0]
    n = 20000
    reqs = [Request(f"r{i}", [1], params, max_tokens=4) for i in range(n)]
    sampler = Sampler(CUDA, seed=0)
    got = torch.tensor(sampler(logits.to(CUDA).expand(n, 50), reqs).token_ids)
    counts = torch.bincount(got, minlength=50).double()
    want = want.double()
    support = want > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], want[support] / want[support].sum() * n).pvalue > 1e-4


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp4"])
def test_greedy_tokens_identical_with_cuda_graphs(llama_dir, kv_cache_dtype):
    prompts = random_prompts(12, 4, 120, seed=6)
    params = [SamplingParams(max_tokens=8 + 4 * i, **GREEDY) for i in range(len(prompts))]
    outputs = {}
    for graphs in (False, True):
        llm = LLM(
            str(llama_dir),
            dtype="float32",
            device="cuda",
            kv_cache_dtype=kv_cache_dtype,
            cuda_graphs=graphs,
        )
        outputs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    stats = llm.engine.runner.graphs.stats
    assert stats.captures > 0 and stats.replays > stats.captures
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_mixture_of_experts_greedy_matches_transformers(tmp_path, arch):
    path = make_checkpoint(tmp_path, arch)
    hf = hf_model(path, torch.float32)
    llm = LLM(str(path), dtype="float32", device="cuda")
    prompts = random_prompts(6, 3, 50, seed=2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
