"""The engine flags of `expresslane generate` and `serve`, and the options they give.

Unset flags are None and give no option, so the defaults are EngineConfig's alone and a flag
given on the command line wins over the config file's value even when it equals the default.
"""

from __future__ import annotations

import argparse

from expresslane.cli.arg_types import (
    DTYPES,
    lane_setting,
    model_dir,
    parse_lane_flags,
    parse_speculative_flag,
    positive_float,
    positive_int,
    speculative,
)
from expresslane.names import KV_CACHE_DTYPES, QUANTIZATIONS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags; unset ones are None (EngineConfig holds the defaults)."""
    p.add_argument(
        "--model",
        type=model_dir,
        metavar="MODEL",
        default=None,
        help="a Hugging Face-format model directory, a .gguf file or a Hub name ORG/NAME "
        "(default: the bundled demo model)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="auto (cuda if this torch has a GPU, else cpu), cpu, cuda or cuda:N (default: auto)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
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
        default=None,
        help="most sequences in one engine step, all tiers (config: max_batch; default: 64)",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        metavar="GIB",
        type=positive_float,
        default=None,
        help="memory for the paged KV cache, in GiB (default: 1)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        type=positive_int,
        default=None,
        help="token budget of one engine step (the prefill chunk size; default: 512)",
    )
    p.add_argument(
        "--no-enable-prefix-caching",
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="do not reuse the KV blocks of shared prompt prefixes",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="run every step in row-invariant kernels: a request's greedy tokens never depend "
        "on what it is batched with (slower prompts where the fast prompt kernels are not "
        "row-invariant; needs the C++ layer stack)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        metavar="N",
        type=positive_int,
        default=None,
        help="split the model's layers over N processes, each on its own cores or device "
        "(config: tensor_parallel_size; default: 1)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="replay decode steps from CUDA graphs captured per batch-size and context bucket "
        "(on a CPU the same steps run eagerly)",
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
        default=None,
        help="KV cache storage: auto (the model's dtype: bf16 rows for a bf16 model computed in "
        "float32), float32, bfloat16, or compressed: fp8 (E4M3, a scale per token and head) or "
        "fp4 (E2M1, an E4M3 scale per 16 values)",
    )
    p.add_argument(
        "--speculative",
        type=speculative,
        default=None,
        metavar="SPEC",
        help="speculative decoding for every lane that sets none: ngram, suffix, draft, or a "
        'TOML table such as \'{method="draft", model="DIR", num_tokens=12}\' (ultrafast uses '
        "suffix unless told otherwise)",
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


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig options the flags set (unset flags give none)."""
    options = {
        name: getattr(args, name)
        for name in (
            "device",
            "dtype",
            "max_model_len",
            "max_batch",
            "kv_cache_memory_gb",
            "max_num_batched_tokens",
            "enable_prefix_caching",
            "batch_invariant",
            "cuda_graphs",
            "tensor_parallel_size",
            "quantization",
            "kv_cache_dtype",
        )
    }
    options["seed"] = getattr(args, "engine_seed", None)
    options["lanes"] = parse_lane_flags(args.lane) or None
    options["speculative"] = parse_speculative_flag(args.speculative)
    return {k: v for k, v in options.items() if v is not None}
