"""Which grammar library to constrain decoding with, measured on this machine.

Both llguidance and xgrammar get the same JSON schemas and the demo model's tokenizer. Each
walks the same random path through its grammar (a seeded choice among the allowed tokens) and
is timed per token mask, plus the compile time of the schema (first use and cached).

    python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import json
import random
import statistics
import time

import torch

from expresslane.demo import TARGET_DIR, demo_model_dir

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    "20 tools": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f"tool_{i}"},
                    "arguments": {
                        "type": "object",
                        "properties": {
                            "path": {"type": "string"},
                            "count": {"type": "integer"},
                            "mode": {"enum": ["r", "w", "a"]},
                        },
                        "required": ["path", "count", "mode"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i in range(20)
        ]
    },
}
STEPS = 120


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < vocab]


def _walk(fill, mask, stopped, consume, vocab: int, eos: int, seed: int) -> list[float]:
    """Seconds of each mask fill along a seeded random path through the grammar."""
    rng = random.Random(seed)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        allowed = _allowed(mask[0], vocab)
        if not allowed or stopped():
            break
        token = rng.choice(allowed)
        consume(token)
        if token == eos:
            break
    return times


def llguidance_walk(tok_json: str, vocab: int, eos: int, schema: dict, seed: int):
    import llguidance
    import llguidance.torch as lt

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - start
    mask = lt.allocate_token_bitmask(1, vocab)
    fill = lambda: lt.fill_next_token_bitmask(matcher, mask, 0)
    times = _walk(fill, mask, matcher.is_stopped, matcher.consume_token, vocab, eos, seed)
    return tok_s, compile_s, times


def xgrammar_walk(model_dir, vocab: int, eos: int, schema: dict, seed: int):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    tok_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    mask = xgr.allocate_token_bitmask(1, vocab)
    fill = lambda: matcher.fill_next_token_bitmask(mask)
    times = _walk(fill, mask, matcher.is_terminated, matcher.accept_token, vocab, eos, seed)
    return tok_s, compile_s, times


def main() -> None:
    model_dir = demo_model_dir(TARGET_DIR)
    tok_json = (model_dir / "tokenizer.json").read_text()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    print(
        f"{'library':<11} {'schema':<9} {'tokenizer ms':>12} {'compile ms':>10} "
        f"{'mask us p50':>11} {'mask us p99':>11} {'steps':>5}"
    )
    for name, schema in SCHEMAS.items():
        for lib in ("llguidance", "xgrammar"):
            all_times, toks, comps = [], [], []
            for seed in range(5):
                if lib == "llguidance":
                    tok_s, comp_s, times = llguidance_walk(tok_json, vocab, eos, schema, seed)
                else:
                    tok_s, comp_s, times = xgrammar_walk(model_dir, vocab, eos, schema, seed)
                all_times += times[1:]
                toks.append(tok_s)
                comps.append(comp_s)
            all_times.sort()
            p99 = all_times[int(0.99 * (len(all_times) - 1))]
            print(
                f"{lib:<11} {name:<9} {statistics.median(toks) * 1e3:>12.1f} "
                f"{statistics.median(comps) * 1e3:>10.1f} "
                f"{statistics.median(all_times) * 1e6:>11.0f} {p99 * 1e6:>11.0f} "
                f"{len(all_times):>5}"
            )


if __name__ == "__main__":
    main()
