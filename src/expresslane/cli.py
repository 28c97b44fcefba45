"""Command line: `expresslane serve|generate|...`."""

from __future__ import annotations

import argparse
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face-format model directory (default: the bundled demo model)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--quantization",
        choices=["nvfp4", "mxfp4"],
        default=None,
        help="quantize linear weights at load (an FP4 checkpoint needs no flag)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp4"],
        default="auto",
        help="store the KV cache compressed: fp8 (E4M3, a scale per token and head) or fp4 "
        "(E2M1, an E4M3 scale per 16 values)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        metavar="SPEC",
        help="speculative decoding for every lane that sets none: ngram, draft, or a TOML table "
        'such as \'{method="draft", model="DIR", num_tokens=12}\' (ultrafast uses ngram '
        "unless told otherwise)",
    )
    p.add_argument(
        "--lane",
        action="append",
        default=[],
        metavar="LANE.SETTING=VALUE",
        help="lane setting, e.g. ultrafast.target_tokens_per_s=150 or flex.enabled=false "
        "(repeatable; see [lanes.*] in the config file)",
    )


def parse_lane_flags(flags: list[str]) -> dict:
    """['ultrafast.max_batch=2', ...] -> {'ultrafast': {'max_batch': 2}}; values are TOML."""
    from expresslane.server.settings import tomllib

    lanes: dict = {}
    for flag in flags:
        name, eq, value = flag.partition("=")
        lane, dot, setting = name.partition(".")
        if not (eq and dot and lane and setting):
            raise SystemExit(f"--lane {flag!r}: expected LANE.SETTING=VALUE")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare word, e.g. auto
        lanes.setdefault(lane, {})[setting] = parsed
    return lanes


def parse_speculative_flag(value: str | None) -> dict | None:
    """'ngram' / 'draft' / a TOML inline table -> the `speculative` option."""
    from expresslane.server.settings import tomllib

    if value is None:
        return None
    if value.strip().startswith("{"):
        try:
            return tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise SystemExit(f"--speculative {value!r}: {e}") from None
    return {"method": value}


def _engine_options(args: argparse.Namespace) -> dict:
    lanes = parse_lane_flags(args.lane)
    speculative = parse_speculative_flag(args.speculative)
    return dict(
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_batch=args.max_batch,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **({"lanes": lanes} if lanes else {}),
        **({"speculative": speculative} if speculative else {}),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from expresslane import LLM, SamplingParams

    llm = LLM(args.model, **_engine_options(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    out = llm.generate([prompt], params)[0]
    print(out.text)
    m = out.metrics
    if args.verbose:
        print(
            f"\n[{len(out.token_ids)} tokens, finish={out.finish_reason}, ttft={m['ttft']:.3f}s, "
            f"decode={m['decode_tokens_per_s'] or 0:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from expresslane.server.app import serve

    return serve(args, _engine_options(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expresslane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("-v", "--verbose", action="store_true")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--config", default=None, help="TOML config file")
    s.add_argument(
        "--accounts", default=None, help="API keys + usage ledger (SQLite); default: see keys"
    )
    s.set_defaults(func=cmd_serve)

    from expresslane.bench.cli import add_bench_command
    from expresslane.cli_accounts import add_account_commands
    from expresslane.cli_quant import add_perplexity_command, add_quantize_command

    add_account_commands(sub)
    add_quantize_command(sub)
    add_perplexity_command(sub)
    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
