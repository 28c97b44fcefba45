"""`expresslane quantize` (a block-scaled 4-bit copy of a checkpoint) and `expresslane
perplexity` (quality on the demo model's held-out corpus, to measure what quantization costs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from expresslane.names import KV_CACHE_DTYPES, QUANTIZATIONS


def cmd_quantize(args: argparse.Namespace) -> int:
    from expresslane.checkpoint import quantize_checkpoint
    from expresslane.errors import ModelLoadError
    from expresslane.quant.checkpoint import DEFAULT_SKIP

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
    q.add_argument("--format", choices=QUANTIZATIONS, required=True)
    q.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep tensors matching this glob unquantized, e.g. 'lm_head.weight' (repeatable; "
        "the embedding table and norms are always kept)",
    )
    q.set_defaults(func=cmd_quantize)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from expresslane import LLM
    from expresslane.perplexity import heldout_text, perplexity

    options = {"dtype": args.dtype}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(args.model, max_model_len=max(args.window, 256), **options)
    result = perplexity(llm, heldout_text(), args.max_tokens, args.window)
    result.update(
        model=args.model or "demo",
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    print(
        json.dumps(result)
        if args.json
        else f"perplexity {result['perplexity']:.3f} "
        f"(loss {result['loss']:.4f} nats/token over {result['tokens']:,} held-out tokens)"
    )
    return 0


def add_perplexity_command(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity on the demo model's held-out corpus")
    p.add_argument("--model", default=None, help="model directory (default: the demo target)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=100_000)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_perplexity)
