"""Command line: `expresslane serve|generate|...`."""

from __future__ import annotations

import argparse
import sys

from expresslane.cli_types import (
    DTYPES,
    Parser,
    fail,
    lane_setting,
    model_dir,
    non_negative_int,
    positive_float,
    positive_int,
    speculative,
)
from expresslane.names import KV_CACHE_DTYPES, QUANTIZATIONS


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=model_dir,
        metavar="DIR",
        default=None,
        help="Hugging Face-format model directory (default: the bundled demo model)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda if this torch has a GPU, else cpu), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="compute dtype; auto: the checkpoint's (on CPUs without fast bf16, float32)",
    )
    p.add_argument(
        "--max-model-len",
        metavar="N",
        type=positive_int,
        default=None,
        help="longest context, prompt + output, in tokens (default: the model's, at most 8192)",
    )
    _capacity_args(p)
    _format_args(p)


def _capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-num-seqs",
        "--max-batch",
        dest="max_batch",
        metavar="N",
        type=positive_int,
        default=64,
        help="most sequences in one engine step, all tiers (config: max_batch)",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        metavar="GIB",
        type=positive_float,
        default=1.0,
        help="memory for the paged KV cache, in GiB",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        type=positive_int,
        default=512,
        help="token budget of one engine step (the prefill chunk size)",
    )
    p.add_argument(
        "--no-enable-prefix-caching",
        "--no-prefix-caching",
        dest="no_prefix_caching",
        action="store_true",
        help="do not reuse the KV blocks of shared prompt prefixes",
    )


def _format_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="quantize linear weights at load (an FP4 checkpoint needs no flag)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="store the KV cache compressed: fp8 (E4M3, a scale per token and head) or fp4 "
        "(E2M1, an E4M3 scale per 16 values)",
    )
    p.add_argument(
        "--speculative",
        type=speculative,
        default=None,
        metavar="SPEC",
        help="speculative decoding for every lane that sets none: ngram, draft, or a TOML table "
        'such as \'{method="draft", model="DIR", num_tokens=12}\' (ultrafast uses ngram '
        "unless told otherwise)",
    )
    p.add_argument(
        "--lane",
        action="append",
        type=lane_setting,
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
            raise ValueError(f"{flag!r}: expected LANE.SETTING=VALUE")
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
            raise ValueError(f"{value!r} is not a TOML table: {e}") from None
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
        seed=getattr(args, "engine_seed", None),
        **({"lanes": lanes} if lanes else {}),
        **({"speculative": speculative} if speculative else {}),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from expresslane import LLM, SamplingParams
    from expresslane.server.preflight import device_problem

    problem = device_problem(args.device)
    if problem:
        return fail("expresslane generate", f"argument --device: {problem}")
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


def _add_generate_command(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _engine_args(g)
    g.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    g.add_argument("--max-tokens", type=positive_int, default=128, help="most tokens to generate")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    g.add_argument(
        "--seed", type=non_negative_int, default=None, help="sampling seed, for repeatable runs"
    )
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument(
        "-v", "--verbose", action="store_true", help="print tokens, TTFT and speed to stderr"
    )
    g.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    # Every command's module is light: what loads torch is imported inside the commands.
    from expresslane.bench.cli import add_bench_command
    from expresslane.cli_accounts import add_account_commands
    from expresslane.cli_cluster import add_cluster_command
    from expresslane.cli_quant import add_perplexity_command, add_quantize_command
    from expresslane.cli_serve import add_serve_command

    parser = Parser(prog="expresslane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_command(sub)
    add_serve_command(sub, _engine_args)
    add_account_commands(sub)
    add_quantize_command(sub)
    add_perplexity_command(sub)
    add_bench_command(sub)
    add_cluster_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named after the command, as its other errors are
        prog = f"{parser.prog} {args.command}"
        return fail(prog, f"unrecognized arguments: {' '.join(extra)} (see `{prog} --help`)")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
