"""FP4 checkpoints: `expresslane quantize` writes them, the loader reads them back.

A Hugging Face-style directory: the original config.json plus a `quantization_config`, the
tokenizer files, and model.safetensors where each quantized linear `X.weight` is replaced by
`X.weight_packed` (uint8 [N, K/2]), `X.weight_scale` (uint8 [N, K/block]: E8M0 exponents or
E4M3 bits) and, for NVFP4, `X.weight_tensor_scale` (float32 [1]).
"""

from __future__ import annotations

import fnmatch

import torch

from expresslane.errors import ModelLoadError
from expresslane.quant.formats import FORMATS, Fp4Tensor, quantize
from expresslane.quant.int4 import Int4Weight
from expresslane.quant.linear import Fp4Weight

QUANT_METHOD = "expresslane_fp4"
# Not linear layers, or kept by default: the embedding table and the norms.
DEFAULT_SKIP = ("model.embed_tokens.weight", "*norm.weight")


def quantize_tensors(
    raw: dict[str, torch.Tensor], config: dict, fmt_name: str, skip=DEFAULT_SKIP
) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize every 2-D `*.weight` not matching a `skip` pattern. Returns the tensors to save
    and a summary; `config` gets its `quantization_config` (and untied embeddings)."""
    fmt = FORMATS.get(fmt_name)
    if fmt is None:
        raise ModelLoadError(f"unknown format {fmt_name!r}; choose from {sorted(FORMATS)}")
    # 4-bit blocks kept from a GGUF file are widened first, as the file's other tensors were
    raw = {n: _widened(t) for n, t in raw.items()}
    # The output projection is a linear layer: a tied one gets its own (quantized) copy.
    untie = not any(fnmatch.fnmatch("lm_head.weight", p) for p in skip)
    if config.get("tie_word_embeddings") and "lm_head.weight" not in raw and untie:
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"]
        config["tie_word_embeddings"] = False
    out: dict[str, torch.Tensor] = {}
    quantized, before, after = 0, 0, 0
    for name, t in raw.items():
        before += t.numel() * 2 if t.is_floating_point() else t.nbytes
        linear = name.endswith(".weight") and t.dim() == 2 and t.shape[1] % fmt.block_size == 0
        if not linear or any(fnmatch.fnmatch(name, p) for p in skip):
            out[name] = t.contiguous()
            after += t.nbytes
            continue
        q = quantize(t, fmt)
        stem = name.removesuffix(".weight")
        out[stem + ".weight_packed"] = q.packed
        out[stem + ".weight_scale"] = q.scales
        if fmt.tensor_scale:
            out[stem + ".weight_tensor_scale"] = torch.tensor([q.tensor_scale])
        quantized += 1
        after += q.nbytes
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format": fmt.name,
        "block_size": fmt.block_size,
        "scale_dtype": fmt.scale_dtype,
        "skip": list(skip),
    }
    summary = {
        "format": fmt.name,
        "quantized_tensors": quantized,
        "bytes_bf16": before,
        "bytes_quantized": after,
    }
    return out, summary


def _widened(t):
    return t.dequantize(torch.bfloat16) if isinstance(t, Int4Weight) else t


def read_fp4_weights(raw: dict[str, torch.Tensor], quant_config: dict) -> None:
    """Replace the `*.weight_packed` / `_scale` / `_tensor_scale` triples in `raw` (in place)
    by `X.weight` entries holding `Fp4Weight`s."""
    if quant_config.get("quant_method") != QUANT_METHOD:
        raise ModelLoadError(
            f"unsupported quantization_config.quant_method "
            f"{quant_config.get('quant_method')!r}; supported: {QUANT_METHOD!r}"
        )
    fmt = FORMATS[quant_config["format"]]
    for name in [n for n in raw if n.endswith(".weight_packed")]:
        stem = name.removesuffix(".weight_packed")
        scale = raw.pop(stem + ".weight_tensor_scale", None)
        t = Fp4Tensor(
            fmt,
            raw.pop(name),
            raw.pop(stem + ".weight_scale"),
            1.0 if scale is None else float(scale),
        )
        raw[stem + ".weight"] = Fp4Weight.from_tensor(t)
