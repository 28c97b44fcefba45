"""Block-scaled 4-bit weights against bf16, same run: decode speed and bytes, and quality.

1. Random weights of the SmolLM2-135M architecture (bf16 checkpoint), quantized with
   `expresslane quantize` to NVFP4 and MXFP4; batch-1 decode tokens/s (prompt 128, 64 new
   tokens, first token excluded), modes interleaved over several rounds (median reported).
   Time to first token (the prompt's forward pass) is reported beside it.
   Weight bytes: what one decode step streams (every linear layer incl. the output
   projection; the embedding table is only indexed) and the checkpoint size on disk.
2. The demo target's perplexity on its held-out corpus (`expresslane perplexity`), bf16
   against NVFP4 and MXFP4 quantized at load: 1024-token windows fed in chunks of 128 and,
   over fewer tokens, in chunks of 8. Where every step runs the native kernels (the FP4
   kernel at any batch, int8 activations) both run the same kernels; elsewhere only the
   small chunks take the decode kernels.

    python benchmarks/quant.py [--rounds 3] [--ppl-tokens 100000] [--formats nvfp4,mxfp4]
                               [--model DIR] [--device auto]

`--model` names another bf16 checkpoint for part 1 (its quantized copies are kept beside the
random one's, under .cache/bench); `--ppl-tokens 0` skips part 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
from common import CACHE, SMOLLM2_135M, machine, model_vocab, random_checkpoint, save_results
from safetensors import safe_open

from expresslane import LLM, SamplingParams
from expresslane.checkpoint import quantize_checkpoint
from expresslane.perplexity import heldout_text, perplexity

PROMPT, NEW = 128, 64
FORMATS = ("nvfp4", "mxfp4")


def streamed_weight_bytes(model_dir) -> int:
    """Bytes of linear-layer weights one decode step reads: every 2-D weight but the
    embedding table (the output projection reads it in full when tied), bf16 at 2 bytes."""
    config = json.loads((model_dir / "config.json").read_text())
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - not a dict
            t = f.get_slice(name)
            numel = math.prod(t.get_shape())
            size = 2 if t.get_dtype() in ("BF16", "F16", "F32") else 1
            if name.endswith(".weight_tensor_scale"):
                size = 4
            is_embed = name == "model.embed_tokens.weight"
            if "norm" in name or (is_embed and not config.get("tie_word_embeddings")):
                continue
            total += numel * size
    return total


def decode_speed(
    llms: dict[str, LLM], rounds: int, vocab: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median decode tokens/s and median time to first token (the 128-token prompt), per mode."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab, (PROMPT,), generator=g).tolist()
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    speeds: dict[str, list[float]] = {name: [] for name in llms}
    ttfts: dict[str, list[float]] = {name: [] for name in llms}
    for llm in llms.values():
        llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(rounds):
        for name, llm in llms.items():
            metrics = llm.generate(prompt, params)[0].metrics
            speeds[name].append(metrics["decode_tokens_per_s"])
            ttfts[name].append(metrics["ttft"])

    def median(samples: dict[str, list[float]]) -> dict[str, float]:
        return {name: statistics.median(v) for name, v in samples.items()}

    return median(speeds), median(ttfts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ppl-tokens", type=int, default=100_000)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--model", default=None, help="a bf16 checkpoint (random SmolLM2-135M)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    results: dict = {"machine": machine(), "args": vars(args)}
    formats = [f for f in args.formats.split(",") if f]

    src = Path(args.model) if args.model else random_checkpoint("smollm2-135m", SMOLLM2_135M)
    name = "smollm2-135m" if args.model is None else src.name
    dirs = {"bf16": src}
    disk = {"bf16": (src / "model.safetensors").stat().st_size}
    for fmt in formats:
        out = CACHE / f"{name}-{fmt}"
        if not (out / "model.safetensors").is_file():
            quantize_checkpoint(src, out, fmt)
        dirs[fmt] = out
        disk[fmt] = (out / "model.safetensors").stat().st_size
    # no prefix cache: every round's time to first token is the whole 128-token prompt
    llms = {
        mode: LLM(str(d), device=args.device, max_model_len=1024, enable_prefix_caching=False)
        for mode, d in dirs.items()
    }
    speed, ttft = decode_speed(llms, args.rounds, model_vocab(src))
    streamed = {name: streamed_weight_bytes(d) for name, d in dirs.items()}
    del llms
    key = "smollm2_135m" if args.model is None else "model"
    results[key] = {
        mode: {
            "decode_tok_s": round(speed[mode], 1),
            "speedup_vs_bf16": round(speed[mode] / speed["bf16"], 2),
            "ttft_ms": round(1000 * ttft[mode], 1),
            "streamed_weight_mb": round(streamed[mode] / 1e6, 1),
            "streamed_vs_bf16": round(streamed[mode] / streamed["bf16"], 3),
            "checkpoint_mb": round(disk[mode] / 1e6, 1),
            "checkpoint_vs_bf16": round(disk[mode] / disk["bf16"], 3),
        }
        for mode in dirs
    }
    for mode, row in results[key].items():
        print(f"{name} {mode}: {row}", flush=True)
    if args.ppl_tokens <= 0:
        print("saved", save_results("quant", results))
        return

    text = heldout_text()
    for key, tokens, chunk in (
        ("demo_perplexity", args.ppl_tokens, 128),
        ("demo_perplexity_decode_kernels", args.ppl_tokens // 5, 8),
    ):
        ppl = {}
        for q in (None, *FORMATS):
            llm = LLM(quantization=q, max_model_len=1024)
            ppl[q or "bf16"] = perplexity(llm, text, tokens, chunk=chunk)["perplexity"]
            del llm
        results[key] = {
            "tokens": tokens,
            **{
                name: {"perplexity": p, "rise_vs_bf16": round(p / ppl["bf16"] - 1, 4)}
                for name, p in ppl.items()
            },
        }
        print(f"{key}:", results[key], flush=True)
    print("saved", save_results("quant", results))


if __name__ == "__main__":
    main()
