"""Command line: `expresslane serve|generate|...`."""

from __future__ import annotations

import argparse
import sys

from expresslane.cli.arg_types import (
    Parser,
    fail,
    non_negative_int,
    positive_int,
)
from expresslane.cli.engine import add_engine_args, engine_options


def cmd_generate(args: argparse.Namespace) -> int:
    from expresslane import LLM, SamplingParams
    from expresslane.server.preflight import device_problem

    problem = device_problem(args.device or "auto")
    if problem:
        return fail("expresslane generate", f"argument --device: {problem}")
    llm = LLM(args.model, **engine_options(args))
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
    add_engine_args(g)
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
    from expresslane.cli.accounts import add_account_commands
    from expresslane.cli.cluster import add_cluster_command
    from expresslane.cli.quant import add_perplexity_command, add_quantize_command
    from expresslane.cli.serve import add_serve_command

    parser = Parser(prog="expresslane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_command(sub)
    add_serve_command(sub, add_engine_args)
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
