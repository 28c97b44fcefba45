"""A Hugging Face checkpoint's tensor files: which there are (one file or the shards its
index lists, or the GGUF file a `model_source` view links to) and reading them. Shared by the
model loader, `expresslane quantize` (which writes a quantized copy here) and the draft model,
so neither `models/` nor `quant/` imports the other for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expresslane.errors import ModelLoadError
from expresslane.quant.checkpoint import DEFAULT_SKIP, quantize_tensors
from expresslane.quant.mxfp4_experts import GPT_OSS, quantize_gpt_oss


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ModelLoadError(
            f"no weights to load in {model_dir}: expected model.safetensors or the shards "
            f"listed in model.safetensors.index.json{_missing_note(missing)}"
        )
    return files


def _missing_note(missing: list[str]) -> str:
    return f" (missing: {', '.join(missing)})" if missing else ""


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    gguf = Path(model_dir) / "model.gguf"
    if gguf.exists() and not any(Path(model_dir).glob("*.safetensors")):
        from expresslane.gguf_file import GgufFile

        return GgufFile(gguf).tensors()
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name] = sf.get_tensor(name)
    return tensors


def quantize_checkpoint(src: Path, dst: Path, fmt_name: str, skip=DEFAULT_SKIP) -> dict:
    """`expresslane quantize`: write an FP4 copy of the checkpoint at `src` to `dst`
    (`quant.checkpoint.quantize_tensors` over its tensors, or for gpt-oss its experts in
    OpenAI's MXFP4 layout, `quant.mxfp4_experts`; its other files copied)."""
    config = json.loads((src / "config.json").read_text())
    if GPT_OSS in (config.get("architectures") or []):  # experts only, in OpenAI's layout
        out, summary = quantize_gpt_oss(read_checkpoint(src), config, fmt_name)
    else:
        out, summary = quantize_tensors(read_checkpoint(src), config, fmt_name, tuple(skip))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy2(f, dst / f.name)
    return summary
