"""The execution plan: the path each linear takes and which steps run the C++ layer stack."""

from __future__ import annotations

import logging

import pytest
import torch

from expresslane import kernels
from expresslane.kernels import cpu_kernels, plan
from expresslane.kernels.plan import FP4_STACK_ROWS, ROW_KERNEL_ROWS, ExecutionPlan, LinearPath

P = LinearPath


def make(head: LinearPath, layers: LinearPath, stack: bool = True) -> ExecutionPlan:
    return ExecutionPlan.of(torch.float32, "PlainKV", head, [layers] * 8, stack)


def test_row_invariant_linears_run_every_step_in_the_stack():
    p = make(P.BF16_DOT, P.BF16_DOT)
    assert p.every_step and p.batch_invariant and p.native_head
    assert p.uses_stack(4096, decode_only=False) and p.uses_stack(1, decode_only=True)
    assert p.linears == {P.BF16_DOT: 9}


def test_row_kernels_run_small_decode_steps_only():
    p = make(P.BF16_ROWS, P.BF16_ROWS)
    assert not p.every_step and p.native_head and p.stack_rows == ROW_KERNEL_ROWS
    assert p.uses_stack(ROW_KERNEL_ROWS, decode_only=True)
    assert not p.uses_stack(ROW_KERNEL_ROWS + 1, decode_only=True)
    assert not p.uses_stack(2, decode_only=False)  # a prompt token in the step
    assert "<= 16 tokens" in p.describe()


def test_batch_invariant_runs_row_kernels_in_every_step():
    """Asked for, every step runs the stack (its row kernels take any batch), not oneDNN for
    large ones; a head outside the stack cannot be made batch-invariant."""
    p = ExecutionPlan.of(torch.float32, "PlainKV", P.BF16_ROWS, [P.BF16_ROWS] * 8, True, True, True)
    assert p.every_step and p.batch_invariant and p.uses_stack(4096, decode_only=False)
    assert "prompt attention tiled" in p.describe()
    dense_head = ExecutionPlan.of(
        torch.float32, "PlainKV", P.ONEDNN, [P.FP4_W4A8] * 8, True, batch_invariant=True
    )
    assert not dense_head.batch_invariant
    assert "prompt attention row by row" in dense_head.describe()


def test_fp4_layers_with_a_dense_head():
    p = make(P.ONEDNN, P.FP4_W4A8)
    assert not p.every_step and not p.native_head and p.stack_rows == FP4_STACK_ROWS
    assert p.uses_stack(FP4_STACK_ROWS, decode_only=True)
    assert "fp4-w4a8" in p.describe() and "head in the stack" not in p.describe()


def test_without_the_stack_every_step_runs_the_python_layers():
    p = make(P.BF16_DOT, P.BF16_DOT, stack=False)
    assert not p.every_step and not p.native_head and p.stack_rows == 0
    assert not p.uses_stack(1, decode_only=True)
    assert "Python layers" in p.describe()


def test_linear_paths_follow_the_machine(monkeypatch):
    w = torch.randn(32, 64).bfloat16()
    assert plan.linear_path(w, torch.bfloat16) in (P.ONEDNN, P.TORCH)  # bf16 compute: dense
    assert plan.fp4_path(torch.bfloat16) is P.FP4_DEQUANTIZE
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)  # no compiler
    assert plan.linear_path(w, torch.float32) is plan.dense_path(torch.float32)
    assert plan.fp4_path(torch.float32) is P.FP4_DEQUANTIZE


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here")
def test_bf16_weights_take_the_kernels():
    w = torch.randn(32, 64).bfloat16()
    dot = cpu_kernels().bf16_dot_available()
    assert plan.linear_path(w, torch.float32) is (P.BF16_DOT if dot else P.BF16_ROWS)
    odd = torch.randn(24, 64).bfloat16()  # not 16-column blocks: the row kernel takes it
    assert plan.linear_path(odd, torch.float32) is P.BF16_ROWS
    assert plan.fp4_path(torch.float32) is P.FP4_W4A8


def test_the_engine_logs_the_plan_it_runs(caplog):
    from expresslane import LLM

    with caplog.at_level(logging.INFO, logger="expresslane.engine"):
        llm = LLM(max_model_len=256)
    model = llm.engine.model
    logged = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert logged == [f"execution plan: {model.plan.describe()}"]
    linears = [model.lm_head, *model.layer_linears()]
    assert sum(model.plan.linears.values()) == len(linears)
    assert all(model.plan.linears[m.path] for m in linears)
    assert model.plan.stack == (model.layer_stack is not None)


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here")
def test_bfloat16_asked_for_takes_the_kernels(llama_bf16_dir):
    """dtype="bfloat16" on a CPU: bf16 weights through the layer stack, float32 activations,
    as for the checkpoint's dtype: the same plan and the same tokens."""
    from expresslane import LLM, SamplingParams

    from .conftest import random_prompts

    asked, auto = LLM(str(llama_bf16_dir), dtype="bfloat16"), LLM(str(llama_bf16_dir))
    assert asked.engine.dtype == torch.float32
    assert asked.engine.model.layer_stack is not None
    assert asked.engine.model.plan == auto.engine.model.plan
    prompts = random_prompts(4, 10, 30, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = [o.token_ids for o in asked.generate(prompts, params)]
    assert tokens == [o.token_ids for o in auto.generate(prompts, params)]
    bf16_kv = LLM(str(llama_bf16_dir), dtype="bfloat16", kv_cache_dtype="bfloat16").engine
    assert "Bf16KV" in bf16_kv.model.plan.describe() and bf16_kv.model.layer_stack is not None
    assert all(store.tensor.dtype == torch.bfloat16 for store in bf16_kv.runner.kv_caches)


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here")
def test_float16_takes_the_row_kernel_in_the_stack(tmp_path, llama_dir):
    """A float16 checkpoint on a CPU: float32 activations, its float16 weights read by the
    packed float16 kernel (AVX-512) or the row kernel (widened exactly) in the layer stack for
    decodes; the tokens and log-probabilities of the same weights in float32, and the same
    tokens with speculation."""
    from expresslane import LLM, SamplingParams
    from expresslane.kernels import cpu_kernels

    from .conftest import bf16_copy, random_prompts

    fp16 = str(bf16_copy(llama_dir, tmp_path / "fp16", torch.float16))
    llm = LLM(fp16)
    model = llm.engine.model
    assert llm.engine.dtype == torch.float32 and model.layer_stack is not None
    assert set(model.plan.linears) == {P.F16_ROWS} and model.plan.stack_rows > 0
    assert llm.engine.kv_store == "plain"  # no float16 KV store: float32 rows
    packed = [lin._half.dim() == 3 for lin in model.layer_linears()]
    assert all(packed) == cpu_kernels().f16_dot_available() and any(packed) == all(packed)
    prompts = random_prompts(4, 10, 30, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    got = llm.generate(prompts, params)
    want = LLM(fp16, dtype="float32").generate(prompts, params)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        x, y = ([e["token"] for e in o.logprobs] for o in (a, b))
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-3, rtol=0)
    spec = {"method": "ngram", "num_tokens": 4, "max_batch": None}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    repeats = [p + p[:6] for p in prompts]
    spec_out = LLM(fp16, speculative=spec).generate(repeats, params)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in llm.generate(repeats, params)]
