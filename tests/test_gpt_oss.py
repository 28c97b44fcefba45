"""gpt-oss (models/gpt_oss.py) against transformers on a random checkpoint: attention sinks,
sliding-window layers alternating with full ones, YaRN, biases on attention and experts, the
router's bias and softmax over the top k, interleaved gate/up and the clamped SwiGLU. Then the
same checkpoint with its experts in MXFP4 as OpenAI publishes them (`*_blocks`, `*_scales`),
kept 4-bit in the FP4 linears, against transformers loading those bytes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from expresslane import LLM, SamplingParams
from expresslane.cli import main
from expresslane.errors import ModelLoadError
from expresslane.kernels import cpu_kernels
from expresslane.kernels.plan import LinearPath
from expresslane.models import ModelConfig, load_model, sink_attention
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.models.rope import rope_frequencies
from expresslane.models.sink_attention import SinkAttention
from expresslane.quant.linear import Fp4Linear

from .conftest import make_checkpoint, random_prompts
from .test_model_parity import hf_greedy, hf_model, prefill_logits

transformers = pytest.importorskip("transformers")
GREEDY = dict(temperature=0, ignore_eos=True)
NEW = 24


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """The random checkpoint with its norms, sinks and biases drawn too (transformers starts
    biases at 0 and sinks near it); the experts' gate/up biases wide enough that the SwiGLU's
    clamp at 7 cuts some."""
    path = make_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "sinks" in name or name.endswith("bias"):
                scale = 4.0 if name.endswith("gate_up_proj_bias") else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mxfp4_dir(gpt_oss_dir, tmp_path_factory):
    """The same checkpoint with every expert weight in MXFP4, in the published layout, as
    `expresslane quantize` writes it (which has no NVFP4 for gpt-oss)."""
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "q"
    assert main(["quantize", "--format", "mxfp4", str(gpt_oss_dir), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    with pytest.raises(SystemExit, match="MXFP4 only"):
        main(["quantize", "--format", "nvfp4", str(gpt_oss_dir), str(out.parent / "nv")])
    return out


def hf_mxfp4(path):
    """transformers on the MXFP4 checkpoint, its experts dequantized on the CPU (its own
    `convert_moe_packed_tensors`, without the hub's Triton kernels)."""
    quant = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=quant
    ).eval()


def our_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """The engine's model on one prompt prefilled in one piece, float32 on CPU."""
    model, cfg = load_model(path, torch.float32, torch.device("cpu"), 512)
    model.bind_kv_cache([torch.zeros(2, cfg.num_kv_heads, 512, cfg.head_dim) for _ in model.layers])
    T = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)])
    return model(ids, torch.arange(T), meta)


@pytest.fixture(scope="module")
def prompts():
    """Mixed lengths, most past the window of 8; the third shares the first's first 24."""
    out = random_prompts(6, 3, 50, seed=8)
    out[2] = out[0][:24] + out[2]
    return out


# gpt-oss-20b's config.json as published (huggingface.co/openai/gpt-oss-20b)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
}


def test_the_published_config_reads_as_transformers_reads_it():
    """gpt-oss-20b's own config.json (transformers 4.55's names: `rope_scaling`, `rope_theta`
    and `experts_per_token` at the top level): windows of 128 on every other layer, 4 of 32
    experts, its clamp, and YaRN's frequencies and attention factor as transformers has them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig.from_dict(GPT_OSS_20B)
    assert cfg.layer_windows == [128, None] * 12 and cfg.sliding_window is None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.swiglu_limit) == (32, 4, 7.0)
    assert cfg.attention_bias and cfg.rope_theta == 150000
    inv_freq, factor = rope_frequencies(cfg)
    hf = transformers.GptOssConfig(**GPT_OSS_20B)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    torch.testing.assert_close(inv_freq, hf_inv_freq)
    assert factor == pytest.approx(hf_factor)


def test_prefill_logits_match_transformers(gpt_oss_dir, monkeypatch):
    monkeypatch.setattr(sink_attention, "QUERY_TILE", 16)  # a 40-token prompt in three tiles
    model, cfg, ours, ref = prefill_logits(gpt_oss_dir, 40, seed=4)
    assert cfg.layer_windows == [8, None, 8]
    assert cfg.rope_scaling["rope_type"] == "yarn"
    assert all(isinstance(layer.attn, SinkAttention) for layer in model.layers)
    assert model.layers[0].o.bias is not None and model.layers[0].qkv.bias is not None
    assert model.layer_stack is None and not model.plan.tiled_prompts  # no sinks in C++
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked: later chunks read the cache in a window
        {"cuda_graphs": True, "max_batch": 8},  # decodes padded to the graphs' batch buckets
    ],
    ids=["whole", "chunked", "graphs"],
)
def test_greedy_matches_transformers(gpt_oss_dir, prompts, options):
    hf = hf_model(gpt_oss_dir)
    llm = LLM(str(gpt_oss_dir), dtype="float32", **options)
    params = SamplingParams(max_tokens=NEW, **GREEDY)
    refs = [hf_greedy(hf, p, NEW) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs  # prefix cache hits
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_ngram_speculation_keeps_transformers_tokens(gpt_oss_dir):
    base = random_prompts(4, 10, 30, seed=9)
    prompts = [p + p[:12] for p in base]  # repeats for the n-gram lookup to find
    hf = hf_model(gpt_oss_dir)
    spec = LLM(
        str(gpt_oss_dir),
        dtype="float32",
        speculative={"method": "ngram", "num_tokens": 4, "max_batch": None},
    )
    outputs = spec.generate(prompts, SamplingParams(max_tokens=32, **GREEDY))
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 32) for p in prompts]


def test_mxfp4_experts_are_read_as_published(gpt_oss_dir, mxfp4_dir):
    """The blocks and scales stay 4-bit, one FP4 linear per expert, and expand to exactly the
    weights transformers dequantizes from them."""
    raw = load_file(mxfp4_dir / "model.safetensors")
    blocks = raw["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, 128, 2, 16)  # [E, 2I, H/32, 16]
    assert raw["model.layers.0.mlp.experts.down_proj_scales"].shape == (4, 64, 2)
    model, _ = load_model(mxfp4_dir, torch.float32, torch.device("cpu"), 512)
    hf = hf_mxfp4(mxfp4_dir)
    for layer, hf_layer in zip(model.layers, hf.model.layers, strict=True):
        experts = hf_layer.mlp.experts
        for e in range(4):
            gate_up, down = layer.moe.gate_up[e], layer.moe.down[e]
            assert isinstance(gate_up, Fp4Linear) and isinstance(down, Fp4Linear)
            if cpu_kernels() is not None:
                assert gate_up.path is LinearPath.FP4_W4A8
            torch.testing.assert_close(gate_up.weight_fp4.dequantize(), experts.gate_up_proj[e].T)
            torch.testing.assert_close(down.weight_fp4.dequantize(), experts.down_proj[e].T)
            torch.testing.assert_close(gate_up.bias, experts.gate_up_proj_bias[e])


def test_mxfp4_prefill_logits_match_transformers(mxfp4_dir, monkeypatch):
    """The experts expanded by the FP4 linears' PyTorch reference give transformers' logits;
    the CPU kernel (activations rounded to int8 per 32 values) stays within 1% of them."""
    from expresslane import kernels

    T = 40
    ids = torch.tensor(random_prompts(1, T, T + 1, seed=4)[0])
    with torch.no_grad():
        ref = hf_mxfp4(mxfp4_dir)(ids[None]).logits[0]
    with_kernels = our_logits(mxfp4_dir, ids)
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    reference = our_logits(mxfp4_dir, ids)
    torch.testing.assert_close(reference, ref, atol=2e-5, rtol=1e-4)
    assert (with_kernels - ref).norm() / ref.norm() < 0.01


def test_mxfp4_greedy_matches_transformers(mxfp4_dir, prompts, monkeypatch):
    """Greedy tokens of the 4-bit experts through the FP4 linears' reference (the path
    without the CPU kernels; float activations, as on CUDA): transformers' on the same
    bytes. The CPU kernel's int8 activations move this random model's logits by up to ~1%
    (the logits test above), about half its smallest top-two gaps, so its tokens are
    compared there, not here."""
    from expresslane import kernels

    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    hf = hf_mxfp4(mxfp4_dir)
    llm = LLM(str(mxfp4_dir), dtype="float32")
    assert llm.engine.model.layers[0].moe.gate_up[0].path is LinearPath.FP4_DEQUANTIZE
    params = SamplingParams(max_tokens=NEW, **GREEDY)
    refs = [hf_greedy(hf, p, NEW) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs


def test_mxfp4_at_load_equals_the_published_layout(gpt_oss_dir, mxfp4_dir, prompts):
    """`quantization="mxfp4"` on the bf16/float32 checkpoint quantizes its experts at load as
    the MXFP4 checkpoint stores them; NVFP4 experts are refused."""
    params = SamplingParams(max_tokens=8, **GREEDY)
    at_load = LLM(str(gpt_oss_dir), dtype="float32", quantization="mxfp4")
    assert isinstance(at_load.engine.model.layers[0].moe.down[0], Fp4Linear)
    published = LLM(str(mxfp4_dir), dtype="float32")
    assert [o.token_ids for o in at_load.generate(prompts, params)] == [
        o.token_ids for o in published.generate(prompts, params)
    ]
    with pytest.raises(ModelLoadError, match="MXFP4 experts"):
        LLM(str(gpt_oss_dir), dtype="float32", quantization="nvfp4")


def test_a_token_alone_sums_its_experts_as_a_batch_does(mxfp4_dir):
    """A batch-1 step skips the sort by expert (`SparseMoE._one_token`, or one call of the C++
    expert block) and sums the same experts in the same order: with the FP4 kernel's
    row-invariant rows, bit for bit."""
    model, _ = load_model(mxfp4_dir, torch.float32, torch.device("cpu"), 512)
    if model.layers[0].moe.gate_up[0].path is not LinearPath.FP4_W4A8:
        pytest.skip("no CPU kernels here: the reference's matmuls depend on the rows")
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    for moe in (layer.moe for layer in model.layers):
        assert moe.native is not None  # the experts in C++
        weights, experts = moe.route(x)
        batch = moe._grouped(x, weights, experts)
        for i, row in enumerate(x):
            alone = moe._one_token(row[None], weights[i], experts[i])
            assert torch.equal(alone, batch[i : i + 1])
            assert torch.equal(moe.native.token(row[None], experts[i], weights[i]), alone)


def test_an_fp8_kv_cache_with_speculation_and_preemption(gpt_oss_dir):
    """The sink attention reads FP8 blocks as the stores write them: n-gram guesses rolled
    back and requests preempted on a pool too small for all keep the plain run's tokens."""
    prompts = [p + p for p in random_prompts(6, 10, 40, seed=12)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    opts = dict(dtype="float32", kv_cache_dtype="fp8")
    plain = LLM(str(gpt_oss_dir), **opts).generate(prompts, params)
    llm = LLM(str(gpt_oss_dir), speculative={"num_tokens": 4}, num_kv_blocks=20, **opts)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert any(o.metrics["num_preemptions"] for o in spec)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
