"""MXFP4 / NVFP4 reference formats: the exact grid, round-to-nearest-even, packing, scales."""

from __future__ import annotations

import pytest
import torch

from expresslane.quant.formats import (
    E2M1_VALUES,
    MXFP4,
    NVFP4,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)


def test_e2m1_grid_and_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values.tolist() == list(E2M1_VALUES)
    assert torch.equal(e2m1_encode(values), codes)  # -0.0 keeps its sign: code 8


def test_e2m1_rounds_to_nearest_even_and_clamps():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, -1, -4]
    assert e2m1_decode(e2m1_encode(torch.tensor([7.0, -100.0, 0.3, -0.1]))).tolist() == [
        6,
        -6,
        0.5,
        -0.0,
    ]
    # Away from ties: the nearest grid point, by brute force.
    x = torch.empty(10_000).uniform_(-7, 7, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor(E2M1_VALUES[:8])
    nearest = grid[(x.abs().unsqueeze(1) - grid).abs().argmin(dim=1)] * x.sign()
    assert torch.equal(e2m1_decode(e2m1_encode(x)), nearest)


def test_two_codes_per_byte_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_mxfp4_power_of_two_scales_follow_the_ocp_rule():
    w = torch.zeros(2, 64)
    w[0, :32] = 1.0  # amax 1 -> scale 2^-2, 1.0 is stored as 4
    w[0, 32] = 7.0  # amax 7 -> scale 1: 7 clips to 6
    w[0, 33] = -0.75
    w[1, :32] = torch.tensor(E2M1_VALUES * 2) * 8  # exactly representable at scale 8
    q = quantize(w, MXFP4)
    assert q.scales.tolist() == [[125, 127], [130, 0]]
    out = q.dequantize()
    assert torch.equal(out[0, :32], torch.ones(32))
    assert out[0, 32].item() == 6.0 and out[0, 33].item() == -1.0  # tie to even: 0.75 -> 1
    assert torch.equal(out[1, :32], w[1, :32])
    assert q.nbytes == 2 * 32 + 2 * 2  # 4.25 bits per value


def test_nvfp4_two_level_scales():
    w = torch.tensor(E2M1_VALUES * 2).view(2, 16) * torch.tensor([[1.0], [0.01]])
    q = quantize(w, NVFP4)
    assert q.tensor_scale == pytest.approx(6.0 / (448 * 6))
    # the tensor's largest block gets E4M3's largest scale, 448 (bits 0x7E)
    assert q.scales[0, 0].item() == 0x7E
    assert torch.allclose(q.dequantize(), w, rtol=0.07, atol=0)
    assert torch.equal(q.dequantize()[0], w[0])


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_quantization_error_of_gaussian_weights(fmt):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    q = quantize(w, fmt)
    err = (q.dequantize() - w).norm() / w.norm()
    assert err < {"mxfp4": 0.14, "nvfp4": 0.11}[fmt.name]
    bf16_bytes = w.numel() * 2
    assert q.nbytes / bf16_bytes == pytest.approx(fmt.bits_per_value / 16, abs=1e-3)
    with pytest.raises(ValueError, match="multiple of"):
        quantize(torch.ones(4, fmt.block_size + 8), fmt)
