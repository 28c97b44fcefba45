"""The C++ expert block (kernels/experts_cpu.cpp) against the PyTorch path of models/moe.py:
gpt-oss experts in MXFP4 and bf16 and Qwen3-MoE experts in bf16, with and without biases, at
sizes the kernels take that are not powers of two."""

from __future__ import annotations

import pytest
import torch

from expresslane.kernels import cpu_kernels
from expresslane.kernels.plan import LinearPath
from expresslane.models.gpt_oss import GptOssMoEConfig
from expresslane.models.moe import MoEConfig, native_experts
from expresslane.quant.formats import MXFP4, quantize
from expresslane.quant.linear import Fp4Weight

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no CPU kernels here")

E, TOP_K = 6, 3
# (hidden, expert intermediate): FP4 needs multiples of 32 (odd counts of 32-value groups
# here), bf16 dot products 16 output columns and even inputs
SIZES = {"mxfp4": (96, 160), "bf16": (80, 40)}
CASES = [
    ("gpt_oss", "mxfp4", True),
    ("gpt_oss", "mxfp4", False),
    ("gpt_oss", "bf16", True),
    ("gpt_oss", "bf16", False),
    ("qwen3moe", "bf16", False),
    ("qwen3moe", "bf16", True),
]


def make_block(arch: str, weights: str, biases: bool, seed: int = 0):
    """A block of random experts with its linears laid out for the CPU kernels, before
    `bind_kernels` (the reference path)."""
    hidden, ffn = SIZES[weights]
    g = torch.Generator().manual_seed(seed)
    w = {"router": torch.randn(E, hidden, generator=g) * 0.3}
    w["router_bias"] = torch.randn(E, generator=g)
    for e in range(E):
        for name, shape in (("gate_up", (2 * ffn, hidden)), ("down", (hidden, ffn))):
            t = (torch.randn(*shape, generator=g) * 0.15).to(torch.bfloat16)
            if weights == "mxfp4":
                t = Fp4Weight.from_tensor(quantize(t, MXFP4))
            w[f"experts.{e}.{name}"] = t
            if biases:  # wide enough on gate_up that gpt-oss's clamp at 7 cuts some
                w[f"experts.{e}.{name}_bias"] = torch.randn(shape[0], generator=g) * 4
    args = dict(num_experts=E, top_k=TOP_K, intermediate_size=ffn, dense_layers=frozenset())
    if arch == "gpt_oss":
        block = GptOssMoEConfig(norm_topk_prob=True, **args).make_block(w)
    else:
        block = MoEConfig(norm_topk_prob=True, **args).make_block(w)
    for m in [*block.gate_up, *block.down]:
        m.prepare_cpu(torch.float32)
    return block


def gaps(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


@pytest.mark.parametrize("arch, weights, biases", CASES)
def test_the_cpp_experts_match_the_pytorch_path(arch, weights, biases):
    """A decode token (one C++ call for its routed experts and their sum) and a batch (one C++
    call per expert) against the PyTorch path over the same kernels' linears. They differ in
    the activation's exp only (a polynomial within 1.2e-7 of it, not torch's), which may move
    the down linear's rounding of an input: to bf16 by at most 2^-8 of it (one such moves the
    output by less than the bound), to int8 by 1/127 of its block's maximum (~2e-3 of the
    output here); a gpt-oss activation 1% off moves it by ~1.5e-3, a bias left out by far
    more. Measured here: no rounding moved, the same floats."""
    block = make_block(arch, weights, biases)
    expected = LinearPath.FP4_W4A8 if weights == "mxfp4" else LinearPath.BF16_DOT
    if block.gate_up[0].path is not expected:
        pytest.skip(f"no {expected} kernel on this CPU")
    x = torch.randn(5, block.router.shape[1], generator=torch.Generator().manual_seed(1)) * 2
    with torch.inference_mode():
        ref_rows = [block(row[None]) for row in x]
        ref_batch = block(x)
        block.bind_kernels()
        assert block.native is not None
        rows = [block(row[None]) for row in x]
        batch = block(x)
    bound = 5e-3 if weights == "mxfp4" else 2e-4
    for ours, ref in zip(rows, ref_rows, strict=True):
        assert gaps(ours, ref) < bound
    assert gaps(batch, ref_batch) < bound
    # a token's sum is the batch's, expert by expert in the same order, bit for bit
    with torch.inference_mode():
        probs, chosen = block.route(x)
        batch = block._grouped(x, probs, chosen)
        for i in range(len(x)):
            alone = block.native.token(x[i : i + 1], chosen[i], probs[i])
            assert torch.equal(alone, batch[i : i + 1])


def test_an_expert_block_is_declined_where_a_linear_has_no_kernel():
    block = make_block("qwen3moe", "bf16", False)
    block.down[2].path = LinearPath.ONEDNN  # as a float32 weight would be laid out
    assert native_experts(block) is None
