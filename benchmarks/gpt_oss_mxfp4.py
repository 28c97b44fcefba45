"""gpt-oss at batch 1 with its experts in MXFP4, as OpenAI publishes them, against the same
checkpoint with bf16 experts, in one run, alternating rounds.

Random bf16 weights of a gpt-oss scaled down from gpt-oss-20b's proportions (experts about
4x the attention's parameters per layer, the output head about a third of the active
experts'): 8 layers, hidden 1024, 16 experts of 1024 with 4 routed per token, 16 query and 4
KV heads of 64, vocabulary 32000. The MXFP4 copy quantizes every expert weight to the
published `*_blocks` / `*_scales` layout (quant/mxfp4_experts.py); everything else is the same
bf16 in both. Prompt 64 tokens, 64 new, first token excluded. Besides the decode speed, the
time a decode step spends in the expert blocks (router, experts, their sum), timed around
each block's forward at one row.

    python benchmarks/gpt_oss_mxfp4.py [--rounds 3] [--device auto] [--threads N]

`--threads 1` keeps threads from waiting on each other where other work shares the cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import CACHE, machine, random_prompt_decode_speed, save_results

from expresslane import LLM
from expresslane.checkpoint import quantize_checkpoint
from expresslane.models.gpt_oss import GptOssMoE

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
    eos_token_id=2,
)
PROMPT, NEW = 64, 64


def bf16_checkpoint():
    import transformers

    out = CACHE / "gpt-oss-16x1024-bf16"
    if not (out / "model.safetensors").is_file():
        torch.manual_seed(0)
        cfg = transformers.GptOssConfig(**SHAPE)
        transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def mxfp4_checkpoint(src):
    """What `expresslane quantize --format mxfp4` writes for gpt-oss: OpenAI's layout."""
    out = CACHE / "gpt-oss-16x1024-mxfp4"
    if not (out / "model.safetensors").is_file():
        quantize_checkpoint(src, out, "mxfp4")
    return out


class BlockTimer:
    """Seconds spent in the expert blocks' forward at one row (decode steps), and calls."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        forward = GptOssMoE.forward

        def timed(block, x):
            if x.shape[0] != 1:
                return forward(block, x)
            start = time.perf_counter()
            out = forward(block, x)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        GptOssMoE.forward = timed

    def take_ms_per_step(self) -> float:
        ms = 1000 * self.seconds / self.calls * SHAPE["num_hidden_layers"]
        self.seconds, self.calls = 0.0, 0
        return ms


def decode_speed(llm: LLM) -> float:
    return random_prompt_decode_speed(llm, SHAPE["vocab_size"], PROMPT, NEW, low=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: its own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = bf16_checkpoint()
    options = dict(device=args.device, max_model_len=256)
    llms = {"bf16": LLM(str(bf16), **options), "mxfp4": LLM(str(mxfp4_checkpoint(bf16)), **options)}
    speeds: dict[str, list[float]] = {name: [] for name in llms}
    expert_ms: dict[str, list[float]] = {name: [] for name in llms}
    timer = BlockTimer()
    for llm in llms.values():
        decode_speed(llm)  # warm-up
    timer.take_ms_per_step()
    for _ in range(args.rounds):
        for name, llm in llms.items():
            speeds[name].append(decode_speed(llm))
            expert_ms[name].append(timer.take_ms_per_step())
    median = {name: statistics.median(v) for name, v in speeds.items()}
    blocks = {name: statistics.median(v) for name, v in expert_ms.items()}
    results = {
        "machine": machine(),
        "shape": SHAPE,
        "decode_tok_s": median,
        "rounds": speeds,
        "expert_blocks_ms_per_step": blocks,
        "expert_ms_rounds": expert_ms,
        "mxfp4_speedup": median["mxfp4"] / median["bf16"],
        "mxfp4_expert_blocks_speedup": blocks["bf16"] / blocks["mxfp4"],
    }
    for name, value in median.items():
        print(
            f"{name} experts: {value:.1f} tok/s ({1000 / value:.2f} ms per step, "
            f"{blocks[name]:.2f} ms of it in the expert blocks)"
        )
    print(f"MXFP4 experts / bf16 experts: {results['mxfp4_speedup']:.2f}x the decode speed, ")
    print(f"the expert blocks {results['mxfp4_expert_blocks_speedup']:.2f}x faster")
    print(f"saved {save_results('gpt_oss_mxfp4', results)}")


if __name__ == "__main__":
    main()
