"""RoPE scaling (linear, llama3, yarn, dynamic, longrope) against transformers' rope init
functions and rotary embeddings, and a YaRN and a LongRoPE checkpoint end to end."""

from __future__ import annotations

import math

import pytest
import torch

from expresslane.errors import ModelLoadError
from expresslane.models import ModelConfig, load_model
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.models.layers import Rotary
from expresslane.models.rope import rope_frequencies

from .conftest import make_checkpoint, random_prompts
from .test_model_parity import hf_model

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding  # noqa: E402

QWEN2 = {  # Qwen2.5-7B's shape of config, smaller: head_dim 128, theta 1e6
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
    "num_hidden_layers": 1,
    "vocab_size": 128,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
}
LLAMA = {  # head_dim 64
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "vocab_size": 128,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
SHORT = [1.0 + 0.05 * i for i in range(32)]
LONG = [1.0 + 0.4 * i**1.5 for i in range(32)]
PHI3 = {  # Phi-3-mini-128k's layout: the original length at the top level
    **LLAMA,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
}

CASES = {
    "linear": (LLAMA, {"type": "linear", "factor": 2.0}),
    "llama3": (
        LLAMA,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ),
    "yarn": (QWEN2, YARN),
    "yarn-no-truncate": (QWEN2, {**YARN, "truncate": False, "beta_fast": 16, "beta_slow": 2}),
    "yarn-attention-factor": (QWEN2, {**YARN, "attention_factor": 0.9}),
    "yarn-deepseek-mscale": (QWEN2, {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.7}),
    "yarn-factor-from-lengths": (
        {**QWEN2, "max_position_embeddings": 131072},
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32768},
    ),
    "dynamic": (LLAMA, {"type": "dynamic", "factor": 2.0}),
}


def ours(raw: dict, max_positions: int | None = None) -> tuple[ModelConfig, torch.Tensor, float]:
    cfg = ModelConfig.from_dict(raw)
    return cfg, *rope_frequencies(cfg, max_positions or cfg.max_position_embeddings)


def hf_config(raw: dict):
    arch = raw["architectures"][0].removesuffix("ForCausalLM")
    kwargs = {k: v for k, v in raw.items() if k != "architectures"}
    return getattr(transformers, f"{arch}Config")(**kwargs)


def hf_frequencies(raw: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    cfg = hf_config(raw)
    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, None, seq_len=seq_len)


def hf_tables(raw: dict, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin from transformers' rotary embedding on one sequence of `seq_len` tokens:
    it decides by that length, as in a forward pass, which frequencies dynamic and longrope use."""
    cfg = hf_config(raw)
    rotary = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding}[cfg.model_type]
    cos, sin = rotary(cfg)(torch.zeros(1), torch.arange(seq_len)[None])
    return cos[0], sin[0]


def assert_tables_match(raw: dict, max_positions: int, seq_len: int) -> None:
    """Our table's first `seq_len` rows equal transformers' cos and sin for that sequence."""
    _, inv, attention = ours(raw, max_positions)
    rotary = Rotary(inv, max_positions, torch.float32, attention)
    cos, sin = hf_tables(raw, seq_len)
    half = inv.numel()
    rows = torch.tensor([0, 1, 7, seq_len // 3, seq_len - 2, seq_len - 1])
    torch.testing.assert_close(rotary.cos[rows], cos[rows], rtol=1e-6, atol=1e-6)
    ours_sin = torch.cat((-rotary.sin_signed[rows, :half], rotary.sin_signed[rows, half:]), -1)
    torch.testing.assert_close(ours_sin, sin[rows], rtol=1e-6, atol=1e-6)


def assert_frequencies_match(got: tuple[torch.Tensor, float], want: tuple[torch.Tensor, float]):
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    assert got[1] == pytest.approx(want[1], rel=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_match_transformers(case):
    base, scaling = CASES[case]
    raw = {**base, "rope_scaling": scaling}
    assert_frequencies_match(ours(raw)[1:], hf_frequencies(raw))
    assert_tables_match(raw, 1024, 1024)


def test_yarn_carries_its_attention_factor():
    _, _, attention = ours({**QWEN2, "rope_scaling": YARN})
    assert attention == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-12)


def test_rope_parameters_key_reads_as_rope_scaling():
    """transformers 5 saves `rope_parameters` (with rope_theta inside, `type` and `rope_type`)."""
    old = {**QWEN2, "rope_scaling": YARN}
    theta = QWEN2["rope_theta"]
    new = {k: v for k, v in QWEN2.items() if k != "rope_theta"}
    new["rope_parameters"] = {**YARN, "rope_type": "yarn", "rope_theta": theta}
    a, b = ModelConfig.from_dict(old), ModelConfig.from_dict(new)
    assert b.rope_theta == theta
    assert_frequencies_match(rope_frequencies(b), rope_frequencies(a))


def test_dynamic_equals_transformers_within_the_pretraining_length():
    """Served up to max_position_embeddings, dynamic NTK is the plain table: transformers'
    for every sequence that long or shorter."""
    raw = {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    n = raw["max_position_embeddings"]
    for seq_len in (1, 100, n):
        assert_frequencies_match(ours(raw, n)[1:], hf_frequencies(raw, seq_len))
    assert_tables_match(raw, n, n)


def test_dynamic_past_the_pretraining_length_is_vllms_table():
    """Served longer, one NTK base for every position, scaled for factor x the pretraining
    length (vLLM's DynamicNTKScalingRotaryEmbedding); transformers computes the same base for
    a sequence of exactly that length."""
    factor, n = 2.0, LLAMA["max_position_embeddings"]
    raw = {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": factor}}
    cfg, inv, attention = ours(raw, 2 * n)
    dim = cfg.head_dim
    base = cfg.rope_theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
    vllm = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    torch.testing.assert_close(inv, vllm, rtol=1e-6, atol=0)
    assert attention == 1.0
    assert_frequencies_match((inv, attention), hf_frequencies(raw, int(factor * n)))
    assert_tables_match(raw, int(factor * n), int(factor * n))


def test_longrope_within_the_original_length_uses_short_factors():
    """Served up to original_max_position_embeddings (Phi-3's top-level one), the short
    factors: transformers' frequencies and cos/sin for every sequence that long or shorter."""
    n = PHI3["original_max_position_embeddings"]
    cfg, inv, attention = ours(PHI3, n)
    assert cfg.rope_scaling["original_max_position_embeddings"] == n
    for seq_len in (1, n):
        assert_frequencies_match((inv, attention), hf_frequencies(PHI3, seq_len))
    assert attention > 1.0  # sqrt(1 + ln(131072 / 4096) / ln(4096)), on short factors too
    assert_tables_match(PHI3, n, n)


def test_longrope_served_longer_uses_long_factors():
    """Served past the original length, the long factors for every position: transformers'
    long-factor frequencies, and its cos/sin on a sequence past the original length."""
    n = PHI3["original_max_position_embeddings"]
    _, inv, attention = ours(PHI3, 2 * n)
    assert_frequencies_match((inv, attention), hf_frequencies(PHI3, n + 1))
    assert not torch.allclose(inv, hf_frequencies(PHI3, n)[0])  # the short ones differ
    assert_tables_match(PHI3, 2 * n, n + 904)


def test_unknown_or_malformed_rope_scaling_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="'ntk-by-parts'.*linear, llama3, yarn, dynamic, long"):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"type": "ntk-by-parts", "factor": 2}})
    gguf_style = {"type": "longrope", "factor": 32.0}  # the factors kept elsewhere
    with pytest.raises(ModelLoadError, match="longrope rope scaling needs short_factor, long_f"):
        ModelConfig.from_dict({**PHI3, "rope_scaling": gguf_style})
    bad = {**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "long_factor": LONG[:16]}}
    with pytest.raises(ModelLoadError, match="long_factor has 16 entries; head_dim 64 needs 32"):
        ours(bad, 8192)


def prefill_logits_match(path, max_positions: int, prompt_len: int) -> None:
    model, cfg = load_model(path, torch.float32, torch.device("cpu"), max_positions)
    model.bind_kv_cache(
        [torch.zeros(2, cfg.num_kv_heads, 256, cfg.head_dim) for _ in range(cfg.num_layers)]
    )
    T = prompt_len
    ids = torch.tensor(random_prompts(1, T, T + 1)[0])
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)])
    got = model(ids, torch.arange(T), meta)
    with torch.no_grad():
        want = hf_model(path)(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_yarn_checkpoint_matches_transformers(tmp_path):
    """A random Qwen2 with YaRN (factor 4 over an original 64 positions), saved by
    transformers: the engine's prefill logits are transformers'."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    path = make_checkpoint(tmp_path, "qwen2", rope_scaling=yarn, max_position_embeddings=256)
    prefill_logits_match(path, 256, 100)


@pytest.mark.parametrize("prompt_len, max_positions", [(48, 64), (100, 256)], ids=["short", "long"])
def test_longrope_checkpoint_matches_transformers(tmp_path, prompt_len, max_positions):
    """A random Llama with Phi-3-style LongRoPE (original 64 positions at the top level): served
    within 64 positions, short factors; served longer, a prompt past 64 on long factors."""
    longrope = {"type": "longrope", "short_factor": SHORT[:8], "long_factor": LONG[:8]}
    path = make_checkpoint(
        tmp_path,
        "llama",
        rope_scaling=longrope,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
    )
    prefill_logits_match(path, max_positions, prompt_len)


def test_frequency_factors_are_llamacpps_form_of_llama3():
    """A GGUF's `rope_freqs` divide the plain frequencies: llama.cpp writes llama3's that way."""
    llama3 = {**LLAMA, "rope_scaling": CASES["llama3"][1]}
    _, want, _ = ours(llama3)
    _, plain, _ = ours(LLAMA)
    factors = (plain / want).tolist()
    _, got, attention = ours({**LLAMA, "rope_scaling": {"rope_type": "frequency_factors",
                                                        "factors": factors}})  # fmt: skip
    torch.testing.assert_close(got, want)
    assert attention == 1.0
