"""gpt-oss's experts in MXFP4, as OpenAI publishes them (`quantization_config: {quant_method:
"mxfp4"}`): each stacked expert weight `X` of a layer ([E, in, out] in the plain checkpoint)
is stored as `X_blocks` (uint8 [E, out, in / 32, 16]: the 32 E2M1 codes of a block, two per
byte, the first in the low nibble) and `X_scales` (uint8 [E, out, in / 32]: E8M0 exponents,
2^(byte - 127)). Per expert that is exactly our MXFP4 layout of the [out, in] weight, so the
blocks are read as they are, one `Fp4Weight` per expert, and run in the FP4 linears.
transformers' `integrations/mxfp4.py` (`convert_moe_packed_tensors`) dequantizes the same
bytes; tests/test_gpt_oss.py checks against it.
"""

from __future__ import annotations

import torch

from expresslane.errors import ModelLoadError
from expresslane.quant.formats import MXFP4, quantize
from expresslane.quant.linear import Fp4Weight

QUANT_METHOD = "mxfp4"
GPT_OSS = "GptOssForCausalLM"  # the architecture whose experts this layout stores


def is_mxfp4_experts(config: dict) -> bool:
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == QUANT_METHOD


def read_mxfp4_experts(raw: dict) -> None:
    """Replace each `X_blocks` / `X_scales` pair in `raw` (in place) by `X.{e}` entries, one
    `Fp4Weight` [out, in] per expert."""
    for name in [n for n in raw if n.endswith("_blocks")]:
        stem = name.removesuffix("_blocks")
        blocks, scales = raw.pop(name), raw.pop(stem + "_scales")
        experts, rows, groups, width = blocks.shape
        ones = torch.ones(rows, dtype=torch.float32)
        for e in range(experts):
            packed = blocks[e].reshape(rows, groups * width).contiguous()
            raw[f"{stem}.{e}"] = Fp4Weight(MXFP4, packed, scales[e].contiguous(), ones)


def quantize_experts(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a stacked [E, in, out] expert weight, in the published layout."""
    parts = [quantize(w.T, MXFP4) for w in stacked]
    blocks = torch.stack([p.packed for p in parts])
    E, rows, half = blocks.shape
    scales = torch.stack([p.scales for p in parts])
    return blocks.view(E, rows, half // 16, 16), scales


def quantize_checkpoint(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A plain gpt-oss checkpoint's tensors with every expert weight in MXFP4 (biases kept);
    `config` gets OpenAI's `quantization_config`."""
    out = {}
    for name, t in raw.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_experts(t)
        else:
            out[name] = t
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return out


def quantize_gpt_oss(raw: dict[str, torch.Tensor], config: dict, fmt_name: str):
    """`expresslane quantize` on a gpt-oss checkpoint: its experts in MXFP4 as published, the
    rest as it is. Returns the tensors to save and the summary `quantize_tensors` gives."""
    if fmt_name != MXFP4.name:
        raise ModelLoadError(
            f"gpt-oss's experts are quantized to MXFP4 only, as OpenAI publishes them; "
            f"--format {fmt_name} is not available for it"
        )
    out = quantize_checkpoint(raw, config)
    summary = {
        "format": MXFP4.name,
        "quantized_tensors": sum(name.endswith("_blocks") for name in out),
        "bytes_bf16": sum(
            t.numel() * 2 if t.is_floating_point() else t.nbytes for t in raw.values()
        ),
        "bytes_quantized": sum(t.nbytes for t in out.values()),
    }
    return out, summary
