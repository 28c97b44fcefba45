"""GGUF's 4-bit blocks kept 4-bit (quant/int4.py, quant/gguf_blocks.py, kernels/int4_cpu.cpp):
the reference dequantizes exactly as the `gguf` package, the kernel computes the reference
over int8-rounded activations, and the real model (SmolLM2-135M-Instruct Q4_1) through them
against transformers' own GGUF loader."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from expresslane import LLM, SamplingParams
from expresslane.gguf_file import KEEP_4BIT_ENV, GgufFile
from expresslane.kernels import cpu_kernels
from expresslane.kernels.plan import LinearPath
from expresslane.model_source import resolve_model
from expresslane.models import load_model
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.models.loader import fuse_weights
from expresslane.quant.gguf_blocks import int4_from_gguf
from expresslane.quant.int4 import Int4Weight
from expresslane.quant.int4_linear import Int4Linear
from expresslane.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="no AVX2 CPU kernels here")
FORMATS = ("Q4_0", "Q4_1", "Q4_K")


def gguf_rows(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, bytes] of a GGUF tensor: `gguf.quants.quantize` for Q4_0 and Q4_1 (it has no Q4_K
    quantizer); random Q4_K super-blocks with finite float16 d and dmin."""
    rng = np.random.default_rng(seed)
    if name != "Q4_K":
        w = rng.normal(0, 0.05, (n, k)).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    d = rng.normal(0, 1e-3, (n, k // 256, 2)).astype(np.float16)
    blocks[..., :4] = d.view(np.uint8).reshape(n, k // 256, 4)
    return blocks.reshape(n, -1)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels round it: int8 per 32 values, v x (127 / amax) to nearest, even ties."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0.0)
    return (torch.round(blocks * inv) * (amax / 127)).view_as(x)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("k", [256, 512])
def test_dequantize_is_the_gguf_package(name, k):
    data = gguf_rows(name, 48, k, seed=k)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name])
    weight = int4_from_gguf(data, name)
    assert weight.shape == (48, k) and weight.codes.dtype == torch.uint8
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    assert (weight.mins is None) == (name == "Q4_0")
    # Q4_0 and Q4_1 keep their float16 scales; Q4_K's d x sc needs float32
    assert weight.scales.dtype == (torch.float32 if name == "Q4_K" else torch.float16)


def test_fused_parts_keep_every_value():
    """q/k/v or gate/up of different formats (a min of -8 x the scale for Q4_0)."""
    parts = [int4_from_gguf(gguf_rows(f, 32, 256, seed=i), f) for i, f in enumerate(FORMATS)]
    fused = Int4Weight.cat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    q4_0 = [parts[0], int4_from_gguf(gguf_rows("Q4_0", 16, 256, seed=9), "Q4_0")]
    assert Int4Weight.cat(q4_0).mins is None


def test_fuse_weights_widens_a_mixed_projection():
    """Q4_K_M files store v (or down) in 6 bits beside 4-bit q and k: that fused weight is
    widened; whole 4-bit ones stay 4-bit."""
    from expresslane.models.config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 256,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "tie_word_embeddings": True,
        }
    )
    int4 = {
        n: int4_from_gguf(gguf_rows("Q4_1", 256, 256, seed=i), "Q4_1")
        for i, n in enumerate("qkogud")
    }
    p = "model.layers.0."
    raw = {
        "model.embed_tokens.weight": torch.randn(64, 256),
        "model.norm.weight": torch.ones(256),
        p + "input_layernorm.weight": torch.ones(256),
        p + "post_attention_layernorm.weight": torch.ones(256),
        p + "self_attn.q_proj.weight": int4["q"],
        p + "self_attn.k_proj.weight": int4["k"],
        p + "self_attn.v_proj.weight": torch.randn(256, 256).bfloat16(),
        p + "self_attn.o_proj.weight": int4["o"],
        p + "mlp.gate_proj.weight": int4["g"],
        p + "mlp.up_proj.weight": int4["u"],
        p + "mlp.down_proj.weight": int4["d"],
    }
    out = fuse_weights(cfg, raw, torch.float32, torch.bfloat16)
    qkv = out["layers.0.qkv"]
    assert qkv.dtype == torch.bfloat16 and qkv.shape == (768, 256)
    assert torch.equal(qkv[:256], int4["q"].dequantize(torch.bfloat16))
    assert isinstance(out["layers.0.gate_up"], Int4Weight) and isinstance(
        out["layers.0.o"], Int4Weight
    )


@needs_kernels
@pytest.mark.parametrize(("name", "k"), [("Q4_0", 224), ("Q4_1", 576), ("Q4_1", 96), ("Q4_K", 512)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_reference(name, k, m, bias):
    """K = 224: three pairs of 32-groups and one unpaired (with AVX-512: no whole quad);
    576: quads and a pair; 131 rows: passes of several rows leave a remainder."""
    g = torch.Generator().manual_seed(m)
    weight = int4_from_gguf(gguf_rows(name, 131, k, seed=m), name)
    b = torch.randn(131, generator=g) if bias else None
    layer = Int4Linear(weight, b)
    layer.prepare_cpu(torch.float32)
    assert layer.path is LinearPath.INT4_W4A8 and layer.kernel_weights() is not None
    x = torch.randn(m, k, generator=g)
    w = weight.dequantize()
    torch.testing.assert_close(layer.reference(x), F.linear(x, w, b))
    out = layer(x)
    ref = F.linear(int8_rounded(x), w, b)
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
    exact = F.linear(x, w, b)  # and the activation rounding costs little on random inputs
    assert ((out - exact).norm() / exact.norm()) < 0.01


@needs_kernels
def test_kernel_rows_do_not_depend_on_the_batch():
    weight = int4_from_gguf(gguf_rows("Q4_1", 96, 576, seed=1), "Q4_1")
    layer = Int4Linear(weight, torch.randn(96))
    layer.prepare_cpu(torch.float32)
    x = torch.randn(300, 576)
    full = layer(x)
    for rows in (slice(0, 1), slice(3, 7), slice(5, 22), slice(100, 300)):
        assert torch.equal(layer(x[rows]), full[rows])


def test_without_kernels_the_reference_runs(monkeypatch):
    """The path on CUDA and on CPUs without the kernels: the weight expanded in PyTorch."""
    from expresslane import kernels

    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    weight = int4_from_gguf(gguf_rows("Q4_0", 64, 256, seed=2), "Q4_0")
    layer = Int4Linear(weight)
    layer.prepare_cpu(torch.float32)
    assert layer.path is LinearPath.INT4_DEQUANTIZE and layer.kernel_weights() is None
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), F.linear(x, weight.dequantize()))


# --- the real model ------------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "List three colors.",
    "What is 12 + 30?",
]


@pytest.fixture(scope="module")
def chat_ids(smollm2_gguf) -> list[list[int]]:
    tok = Tokenizer.from_dir(resolve_model(str(smollm2_gguf)))
    texts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def prefill_logits(model, cfg, ids: torch.Tensor) -> torch.Tensor:
    T = len(ids)
    model.bind_kv_cache(
        [torch.zeros(2, cfg.num_kv_heads, 256, cfg.head_dim) for _ in range(cfg.num_layers)]
    )
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)])
    return model(ids, torch.arange(T), meta)


def load(gguf_path):
    """As `LLM` loads it on a CPU: float32 compute, bf16 for what is widened."""
    return load_model(
        resolve_model(str(gguf_path)), torch.float32, torch.device("cpu"), 256, torch.bfloat16
    )


def test_the_real_model_keeps_its_blocks_4bit(smollm2_gguf):
    """210 Q4_1 matrices (fused: 120 linears) at 5 bits per weight, no bf16 copies; the
    token embeddings (Q8_0) widened, and the tied output head with them."""
    raw = GgufFile(smollm2_gguf).tensors()
    assert sum(isinstance(t, Int4Weight) for t in raw.values()) == 210
    assert raw["model.embed_tokens.weight"].dtype == torch.bfloat16
    model, _ = load(smollm2_gguf)
    linears = model.layer_linears()
    assert all(isinstance(m, Int4Linear) and m.matrix is None for m in linears)
    if cpu_kernels() is not None:
        assert all(m.path is LinearPath.INT4_W4A8 for m in linears)
    bits = 8 * sum(m.weight_int4.nbytes for m in linears)
    weights = sum(m.weight_int4.shape[0] * m.weight_int4.shape[1] for m in linears)
    assert bits / weights == 5.0  # 4-bit codes, float16 scale and min per 32
    assert model.lm_head.path is not LinearPath.INT4_W4A8  # the embeddings, bf16


def test_real_model_logits_match_transformers_gguf_loader(smollm2_gguf, chat_ids, monkeypatch):
    """Prefill logits against transformers reading the same file in float32. Measured on this
    prompt (49 tokens; logits up to ~38): with the blocks widened to bf16, 0.85% relative
    (L2) and the same top token at every position; 4-bit with int8 activations, 4.5-4.7%
    relative and 94% of the positions' top tokens (the same activations rounded in PyTorch
    over the exact weights give 4.7%: it is the activations' rounding, spread over every
    layer's four linears, not the kernel)."""
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor(chat_ids[1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    with torch.no_grad():
        ref = hf.eval()(ids[None]).logits[0]

    def error(logits):
        rel = ((logits - ref).norm() / ref.norm()).item()
        return rel, (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()

    model, cfg = load(smollm2_gguf)
    rel, top1 = error(prefill_logits(model, cfg, ids))
    assert rel < 0.07 and top1 >= 0.85, (rel, top1)
    if model.plan.stack:  # the same through the Python layers' kernels
        model.plan = dataclasses.replace(model.plan, stack=False)
        assert error(prefill_logits(model, cfg, ids))[0] < 0.07
    monkeypatch.setenv(KEEP_4BIT_ENV, "0")
    rel, top1 = error(prefill_logits(*load(smollm2_gguf), ids))
    assert rel < 0.015 and top1 == 1.0, (rel, top1)


def test_real_model_greedy_tokens_follow_transformers(smollm2_gguf, smollm2_hf, chat_ids):
    """Greedy tokens on the chat prompts against transformers in float32 (its bf16
    checkpoint), each position scored after transformers' own tokens so far (a free-running
    decode's first difference moves every later token). Measured: 95 of 96 equal, as with the
    blocks widened to bf16. Decoding freely the 4-bit path follows transformers for 9 to 24
    tokens on these prompts (near-ties: "humans" against "the"); widened, token for token
    (tests/test_real_model.py)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)
    n, agree = 24, 0
    for ids in chat_ids:
        t = torch.tensor([ids])
        ref = hf.eval().generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )[0, len(ids) :]
        model, cfg = load(smollm2_gguf)
        logits = prefill_logits(model, cfg, torch.cat([torch.tensor(ids), ref[:-1]]))
        agree += (logits[len(ids) - 1 :].argmax(-1) == ref).sum().item()
    assert agree >= 90, agree
    llm = LLM(str(smollm2_gguf), seed=0)
    answer = llm.generate([chat_ids[0]], SamplingParams(max_tokens=n, temperature=0))[0]
    assert "Paris" in answer.text
