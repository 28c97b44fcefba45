"""`expresslane quantize`: write a block-scaled 4-bit copy of a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_quantize(args: argparse.Namespace) -> int:
    from expresslane.errors import ModelLoadError
    from expresslane.quant.checkpoint import DEFAULT_SKIP, quantize_checkpoint

    src, dst = Path(args.in_dir), Path(args.out_dir)
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src} is not a Hugging Face model directory (no config.json)")
    if json.loads((src / "config.json").read_text()).get("quantization_config"):
        raise SystemExit(f"{src} is already quantized")
    try:
        summary = quantize_checkpoint(src, dst, args.format, DEFAULT_SKIP + tuple(args.skip))
    except ModelLoadError as e:
        raise SystemExit(str(e)) from None
    ratio = summary["bytes_quantized"] / summary["bytes_bf16"]
    print(
        f"{summary['quantized_tensors']} linear weights -> {args.format}; "
        f"{summary['bytes_quantized'] / 2**20:.1f} MiB ({ratio:.0%} of bf16) in {dst}"
    )
    return 0


def add_quantize_command(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a checkpoint's linear layers to MXFP4/NVFP4")
    q.add_argument("in_dir")
    q.add_argument("out_dir")
    q.add_argument("--format", choices=["nvfp4", "mxfp4"], required=True)
    q.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep tensors matching this glob unquantized, e.g. 'lm_head.weight' (repeatable; "
        "the embedding table and norms are always kept)",
    )
    q.set_defaults(func=cmd_quantize)
