"""What a grammar costs: decode tokens/s of schema-constrained against free requests on the demo
model, at batch 1, 8 and 32, in the same run (rounds alternate, the ratio of medians is
reported), and the compile time of a 20-tool call grammar, cold and cached.

    python benchmarks/structured.py [--rounds 5] [--tokens 64] [--no-forced] [--overlap on]
"""

from __future__ import annotations

import argparse
import statistics
import time

from expresslane.config import EngineConfig
from expresslane.demo import demo_model_dir
from expresslane.engine.engine import LLMEngine
from expresslane.sampling_params import SamplingParams
from expresslane.server.grammars import json_schema, tool_calls
from expresslane.server.tool_parsers import HermesToolParser

# a long answer of a fixed shape: every request writes `--tokens` tokens, free or constrained
SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "maxLength": 24},
            "line": {"type": "integer", "minimum": 0},
            "kind": {"enum": ["def", "class", "import"]},
        },
        "required": ["path", "line", "kind"],
        "additionalProperties": False,
    },
}
PROMPT = "<|im_start|>user\nList the definitions in the repository as JSON.<|im_end|>\n"


def decode_rate(eng: LLMEngine, batch: int, tokens: int, constrained: bool) -> float:
    """Output tokens per second of `batch` requests decoding together (prefill excluded)."""
    grammar = json_schema(SCHEMA, "response_format") if constrained else None
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    reqs = [
        eng.add_request(PROMPT + f"<|im_start|>assistant\n{i}", params, add_special_tokens=False)
        for i in range(batch)
    ]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    done, start = sum(r.num_output_tokens for r in reqs), time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    seconds = time.perf_counter() - start
    assert all(r.num_output_tokens == tokens for r in reqs)
    return (sum(r.num_output_tokens for r in reqs) - done) / seconds


def compile_times() -> tuple[float, float]:
    eng_tokenizer = LLMEngine(EngineConfig(model=str(demo_model_dir()), calibrate=False))
    grammars = eng_tokenizer.grammars
    tools = [
        {
            "name": f"tool_{i}",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "count": {"type": "integer"},
                    "mode": {"enum": ["r", "w", "a"]},
                    "flags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["path", "mode"],
                "additionalProperties": False,
            },
        }
        for i in range(20)
    ]
    grammar = tool_calls(HermesToolParser.markup, tools, "auto", True, grammars.literal)
    start = time.perf_counter()
    grammars.matcher(grammar)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    grammars.matcher(grammar)
    return cold, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="fill masks on a worker thread during the forward pass (auto: the engine's choice)",
    )
    ap.add_argument(
        "--no-forced",
        action="store_true",
        help="constrained requests do not guess the tokens their grammar forces (masks only)",
    )
    args = ap.parse_args()
    eng = LLMEngine(
        EngineConfig(model=str(demo_model_dir()), seed=0, num_kv_blocks=2048, calibrate=False)
    )
    if args.overlap != "auto":
        eng.grammars.overlap = args.overlap == "on"
    if args.no_forced:
        eng.speculation.planner.add_forced = lambda running: None
    print(f"masks filled {'during' if eng.grammars.overlap else 'after'} the forward pass", end="")
    print("; forced tokens not guessed" if args.no_forced else "; forced tokens guessed")
    decode_rate(eng, 4, 8, True)  # warm-up: kernels, the grammar cache
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'json/free':>9}")
    for batch in args.batches:
        free, json_ = [], []
        for _ in range(args.rounds):
            free.append(decode_rate(eng, batch, args.tokens, False))
            json_.append(decode_rate(eng, batch, args.tokens, True))
        f, j = statistics.median(free), statistics.median(json_)
        print(f"{batch:>5} {f:>11.0f} {j:>11.0f} {j / f:>9.3f}")
    cold, cached = compile_times()
    print(f"20-tool call grammar: compiled in {cold * 1e3:.1f} ms, cached in {cached * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
