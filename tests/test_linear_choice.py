"""Prompt rows' linears in oneDNN's bf16 matmul where it measured faster than the row kernel
(kernels/linear_choice.py, the layer stack's PromptRows). The suite runs with
EXPRESSLANE_PROMPT_LINEARS=rows (conftest.py); these tests ask for the matrix path."""

from __future__ import annotations

import json

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.kernels import cpu_kernels, linear_choice
from expresslane.kernels.linear_choice import MEASURE_ROWS, _crossover, choose
from expresslane.models.layers import Linear

from .conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)
SHAPES = ((128, 64), (64, 64), (256, 64), (64, 128))  # qkv, o, gate_up, down [N, K]


def _dot_kernel() -> bool:
    built = cpu_kernels()
    return built is not None and built.bf16_dot_available()


needs_dot = pytest.mark.skipif(not _dot_kernel(), reason="needs the AVX-512 BF16 kernels")


def _matrix_llm(monkeypatch, path, rows: int = 4, **options) -> LLM:
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", f"matrix:{rows}")
    return LLM(str(path), **options)


def test_the_crossover_is_where_every_larger_count_gains_enough():
    assert _crossover({32: 1.1, 128: 1.3, 512: 1.5}) == 128
    assert _crossover({32: 1.3, 128: 1.1, 512: 1.5}) == 512
    assert _crossover({32: 2.0, 128: 1.9, 512: 1.2}) == 32
    assert _crossover({32: 0.8, 128: 1.0, 512: 1.19}) is None


def test_the_environment_overrides_the_measurement(monkeypatch):
    weights = [torch.zeros(n, k, dtype=torch.bfloat16) for n, k in SHAPES]
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", "rows")
    assert choose("bf16-dot", weights).matrix_rows is None
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", "matrix:16")
    assert choose("bf16-dot", weights).matrix_rows == 16
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", "fastest")
    with pytest.raises(ValueError, match="rows, matrix:N or measure"):
        choose("bf16-dot", weights)


@needs_dot
def test_measured_once_per_machine_and_shapes_then_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", "measure")
    monkeypatch.setattr(linear_choice, "cache_path", lambda: tmp_path / "choice.json")
    weights = [(torch.randn(n, k) * 0.1).bfloat16() for n, k in SHAPES]
    first = choose("bf16-dot", weights)
    assert first.source == "measured"
    assert sorted(first.gains) == list(MEASURE_ROWS) and min(first.gains.values()) > 0
    assert first.matrix_rows == _crossover(first.gains)
    again = choose("bf16-dot", weights)
    assert (again.source, again.gains, again.matrix_rows) == (
        "cached",
        first.gains,
        first.matrix_rows,
    )
    (key,) = json.loads((tmp_path / "choice.json").read_text())
    assert "bf16-dot 128x64,64x64,256x64,64x128" in key and torch.__version__ in key
    assert "oneDNN" in first.describe()


@needs_dot
def test_the_plan_sends_prompt_rows_to_onednn_unless_batch_invariant(monkeypatch, llama_bf16_dir):
    plan = _matrix_llm(monkeypatch, llama_bf16_dir).engine.model.plan
    assert plan.every_step and plan.matrix_prompt_rows == 4
    assert not plan.batch_invariant  # oneDNN's rows may depend on the rows beside them
    assert ">= 4: oneDNN bf16" in plan.describe()
    llm = _matrix_llm(monkeypatch, llama_bf16_dir, batch_invariant=True)
    plan = llm.engine.model.plan
    assert plan.batch_invariant and plan.matrix_prompt_rows is None
    assert "row kernel (batch invariant)" in plan.describe()
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.matrix is None for m in linears)  # the plain copies are freed


@needs_dot
@pytest.mark.parametrize(("quantization", "atol"), [(None, 2e-2), ("nvfp4", 5e-2)])
def test_prompt_logprobs_match_the_row_kernels(monkeypatch, llama_bf16_dir, quantization, atol):
    """Prompt rows in oneDNN round their activations (as the bf16 row kernel does; the FP4
    one quantizes them to int8 per 32) and their outputs to bf16: the prompt's
    log-probabilities stay within `atol` of the row kernels'."""
    prompts = random_prompts(3, 20, 60, seed=31)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
    monkeypatch.setenv("EXPRESSLANE_PROMPT_LINEARS", "rows")
    rows = LLM(str(llama_bf16_dir), quantization=quantization).generate(prompts, params)
    matrix_llm = _matrix_llm(monkeypatch, llama_bf16_dir, quantization=quantization)
    assert matrix_llm.engine.model.plan.matrix_prompt_rows == 4
    matrix = matrix_llm.generate(prompts, params)
    for a, b in zip(rows, matrix, strict=True):
        x = [e["token"] for e in a.prompt_logprobs[1:]]
        y = [e["token"] for e in b.prompt_logprobs[1:]]
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=atol, rtol=0)
        assert x != y  # the matrix path really ran


@needs_dot
@pytest.mark.parametrize(("batch", "quantization"), [(1, None), (6, None), (6, "nvfp4")])
def test_greedy_outputs_identical_with_speculation_on_matrix_prompts(
    monkeypatch, llama_bf16_dir, batch, quantization
):
    """Verification rows and plain decodes take the row kernel whatever the prompt rows take;
    prompts cut into chunks of 24 tokens run beside other sequences' decodes."""
    base = random_prompts(batch, 10, 60, seed=32)
    prompts = [p + p[:12] for p in base]  # n-grams to look up
    params = SamplingParams(max_tokens=32, **GREEDY)
    options = dict(max_num_batched_tokens=24, quantization=quantization)
    plain = _matrix_llm(monkeypatch, llama_bf16_dir, **options).generate(prompts, params)
    spec_llm = _matrix_llm(
        monkeypatch,
        llama_bf16_dir,
        speculative={"method": "ngram", "num_tokens": 4, "max_batch": None},
        **options,
    )
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.engine.speculation.stats.accepted > 0
    kv = spec_llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
