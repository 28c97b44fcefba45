"""Compressed KV cache stores: accuracy, bytes, and serving with them (prefix caching,
speculative rollback, preemption)."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.errors import InvalidRequestError
from expresslane.kernels import cpu_kernels
from expresslane.models.kv_store import STORES

from .conftest import random_prompts


@pytest.mark.parametrize(
    ("dtype", "max_err", "min_saving"),
    [("fp8", 0.04, 0.45), ("fp4", 0.12, 0.65), ("bfloat16", 0.004, 0.0)],
)
def test_compressed_store_round_trip_and_size(dtype, max_err, min_saving):
    g = torch.Generator().manual_seed(0)
    store = STORES[dtype](2, 64, 64, torch.float32, torch.device("cpu"))
    k = torch.randn(10, 2, 64, generator=g) * torch.logspace(-2, 1, 10).view(10, 1, 1)
    v = torch.randn(10, 2, 64, generator=g)
    slots = torch.tensor([3, 9, 17, 30, 31, 40, 50, 51, 52, 63])
    store.write(k, v, slots)
    back = store.read(slots)
    for got, want in ((back[0].transpose(0, 1), k), (back[1].transpose(0, 1), v)):
        err = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert err.max() < max_err
    bf16 = STORES["plain"].bytes_per_token(2, 64, torch.bfloat16)
    assert 1 - store.bytes_per_token(2, 64, torch.float32) / bf16 >= min_saving


def _hard_kv(g: torch.Generator, t: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows [t, hkv, d] of magnitudes 1e-30 to 1e30, with the quantizers' edge cases."""
    k, v = (torch.randn(t, hkv, d, generator=g) for _ in range(2))
    k *= torch.logspace(-30, 30, t).view(t, 1, 1)
    v *= torch.logspace(-8, 8, t).view(t, 1, 1)
    k[0], k[1] = 0.0, -0.0  # all-zero rows: the smallest scale, zero codes
    v[0, :, ::3] = -0.0  # negative zeros among other values
    v[1, 0, 5], v[2, 1, :16] = 3e38, 1e38  # one huge value, a huge block: the scale clamps
    v[3] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(d // 8)  # E2M1 ties
    v[4] = 1e-6  # the FP8 scale underflows float16
    return k, v


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("dtype", ["plain", "fp8", "fp4", "bfloat16"])
def test_the_native_write_is_the_stores_write_byte_for_byte(dtype):
    """The C++ decode step's K/V write (kernels/paged_kv.h, reached through the module's
    write_kv) against the store's own `write`, the reference: every byte, values and scales."""
    g = torch.Generator().manual_seed(7)
    hkv, d, t, slots_total = 2, 64, 48, 80
    k, v = _hard_kv(g, t, hkv, d)
    slots = torch.randperm(slots_total, generator=g)[:t]
    python, native = (STORES[dtype](hkv, slots_total, d, torch.float32, "cpu") for _ in range(2))
    python.write(k, v, slots)
    cpu_kernels().write_kv(native.native(), native.NATIVE_KIND, k, v, slots)
    for mine, reference in zip(native.native(), python.native(), strict=True):
        assert torch.equal(mine.view(torch.uint8), reference.view(torch.uint8))


@pytest.mark.parametrize("dtype", ["fp8", "fp4"])
def test_zero_and_tiny_rows_read_back_finite(dtype):
    """A K/V row of zeros reads back as zeros, a row of tiny values as small finite ones
    (FP4 flushes them to zero; an FP8 scale floor below float16's smallest step once stored
    zero rows as NaN)."""
    store = STORES[dtype](1, 4, 32, torch.float32, torch.device("cpu"))
    k = torch.zeros(4, 1, 32)
    k[1] = -0.0
    k[2] = 1e-6 * torch.linspace(-1, 1, 32)
    k[3] = 1e-9
    store.write(k, k.clone(), torch.arange(4))
    back = store.read(torch.arange(4))[0, 0]
    assert torch.isfinite(back).all()
    assert torch.equal(back[:2], torch.zeros(2, 32))
    assert (back[2:] - k[2:, 0]).abs().max() <= 1e-6


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4", "bfloat16"])
def test_serving_with_a_compressed_kv_cache(llama_dir, kv_dtype):
    prompts = [p + p for p in random_prompts(6, 10, 40, seed=12)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    opts = dict(dtype="float32", kv_cache_dtype=kv_dtype)
    plain = LLM(str(llama_dir), **opts).generate(prompts, params)
    llm = LLM(str(llama_dir), speculative={"num_tokens": 4}, num_kv_blocks=20, **opts)
    spec = llm.generate(prompts, params)  # rollback and preemption on compressed blocks
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert any(o.metrics["num_preemptions"] for o in spec)
    llm.generate(prompts[0], params)
    again = llm.generate(prompts[0], params)[0]  # its prompt blocks come from the cache
    assert again.num_cached_tokens > 0 and again.token_ids == plain[0].token_ids
    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.model.layer_stack is None  # float32 weights: no C++ layer stack
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        LLM(str(llama_dir), kv_cache_dtype="int2")


def test_compressed_kv_stays_close_to_plain(llama_dir):
    """Teacher-forced logits through each store: compression perturbs them only slightly."""
    from expresslane.perplexity import perplexity

    text = (llama_dir / "tokenizer.json").read_text()[:4000]
    ppl = {
        kv: perplexity(LLM(str(llama_dir), dtype="float32", kv_cache_dtype=kv), text, 400, 200)
        for kv in ("auto", "fp8", "fp4")
    }
    base = ppl["auto"]["perplexity"]
    assert ppl["fp8"]["perplexity"] != base  # the compressed store is really read
    assert ppl["fp8"]["perplexity"] == pytest.approx(base, rel=0.01)
    assert ppl["fp4"]["perplexity"] == pytest.approx(base, rel=0.05)


def test_a_32k_token_request_with_fp4_kv_within_budget(tmp_path):
    from .conftest import make_checkpoint

    ckpt = make_checkpoint(tmp_path, "llama", max_position_embeddings=33_000)
    llm = LLM(
        str(ckpt),
        dtype="float32",
        kv_cache_dtype="fp4",
        kv_cache_memory_gb=0.004,  # 4 MB: 58k fp4 tokens (8k in float32)
        max_model_len=32_772,
        max_num_batched_tokens=4096,
    )
    engine = llm.engine
    prompt = torch.randint(3, 512, (32_768,), generator=torch.Generator().manual_seed(1)).tolist()
    req = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.kv.num_used_blocks)
    assert len(req.output_token_ids) == 4
    assert peak * engine.kv.block_size >= 32_768
    assert peak * engine.kv.block_size * engine.kv_bytes_per_token <= 0.004 * 2**30


def test_auto_keeps_the_models_dtype(llama_dir):
    """ "auto" stores bf16 rows for a bf16 model computed in float32 (a CPU's choice), the
    compute dtype otherwise; "float32" asks for float32 rows and needs float32 compute."""
    from expresslane.models.kv_store import store_name

    assert store_name("auto", "bfloat16", torch.float32) == "bfloat16"
    assert store_name("auto", "float32", torch.float32) == "plain"
    assert store_name("auto", "bfloat16", torch.bfloat16) == "plain"
    assert store_name("float32", "bfloat16", torch.float32) == "plain"
    assert store_name("fp8", "bfloat16", torch.float32) == "fp8"
    with pytest.raises(InvalidRequestError, match="float32 compute"):
        store_name("float32", "bfloat16", torch.bfloat16)
    engine = LLM(str(llama_dir), dtype="bfloat16").engine
    assert engine.kv_store == "bfloat16"
    assert type(engine.runner.kv_caches[0]).__name__ == "Bf16KV"
    assert engine.kv_bytes_per_token == 2 * engine.model_config.num_layers * (
        engine.model_config.num_kv_heads * engine.model_config.head_dim * 2
    )
