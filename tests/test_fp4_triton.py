"""The CUDA FP4 linear (kernels/fp4_triton.py) against the reference dequantize + matmul.

With a GPU the compiled kernel runs on it; without one the same kernel runs on CPU tensors
through Triton's interpreter (TRITON_INTERPRET=1, read when the kernel is decorated, so it is
set before the module is imported)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from expresslane.kernels.fp4_triton import fp4_linear_triton  # noqa: E402
from expresslane.quant.formats import FORMATS, quantize  # noqa: E402
from expresslane.quant.linear import Fp4Linear, Fp4Weight  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.cuda  # one of the GPU check's tests (benchmarks/gpu_check.sh)


def fused_weight(fmt_name: str, k: int, seed: int) -> Fp4Weight:
    """Three parts with their own tensor scales, as a fused qkv / gate_up projection has."""
    g = torch.Generator().manual_seed(seed)
    parts = [
        quantize(torch.randn(n, k, generator=g) * 0.05, FORMATS[fmt_name]) for n in (48, 40, 42)
    ]
    return Fp4Weight.cat([Fp4Weight.from_tensor(p) for p in parts]).to(torch.device(DEVICE))


# K = 160 and 96 leave a partial 128-wide K tile; N = 130 a partial 64-wide N tile
@pytest.mark.parametrize(("fmt_name", "k"), [("nvfp4", 256), ("mxfp4", 160), ("nvfp4", 96)])
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_fp4_linear_matches_dequantize_then_matmul(fmt_name, k, m, bias):
    weight = fused_weight(fmt_name, k, seed=m)
    fmt = weight.fmt
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    b = torch.randn(130, generator=g).to(DEVICE) if bias else None
    out = fp4_linear_triton(
        x, weight.packed, weight.scales, weight.row_scales, b, fmt.block_size, fmt.kernel_scale_kind
    )
    torch.testing.assert_close(out, F.linear(x, weight.dequantize(), b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            torch.bfloat16,
            # numpy has no bf16: the interpreter's tl.dot returns garbage even for plain bf16
            # tiles (checked with a two-line kernel), so bf16 is only checked on a GPU
            marks=pytest.mark.skipif(not CUDA, reason="Triton's interpreter cannot dot bf16"),
        ),
        torch.float16,
    ],
)
def test_triton_fp4_linear_half_precision_activations(dtype):
    weight = fused_weight("nvfp4", 128, seed=7)
    fmt = weight.fmt
    x = torch.randn(4, 2, 128, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    out = fp4_linear_triton(
        x, weight.packed, weight.scales, weight.row_scales, None, fmt.block_size, 1
    )
    assert out.shape == (4, 2, 130) and out.dtype == dtype
    ref = F.linear(x.float(), weight.dequantize())  # the kernel accumulates in fp32
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_triton_fp4_linear_rejects_mismatched_inputs():
    weight = fused_weight("mxfp4", 64, seed=1)
    with pytest.raises(ValueError, match="64 inputs, activations of 96"):
        fp4_linear_triton(
            torch.randn(1, 96).to(DEVICE),
            weight.packed,
            weight.scales,
            weight.row_scales,
            None,
            32,
            0,
        )


@pytest.mark.skipif(not CUDA, reason="Fp4Linear routes CUDA tensors to the Triton kernel")
def test_fp4_linear_layer_uses_the_triton_kernel_on_cuda():
    weight = fused_weight("nvfp4", 256, seed=3)
    layer = Fp4Linear(weight)
    x = torch.randn(5, 256, device="cuda")
    torch.testing.assert_close(layer(x), layer.reference(x), atol=1e-4, rtol=1e-4)
