"""A mixture of experts at batch 1 reads only the experts it routes to: its decode speed
beside a dense model with the same active parameters, and beside the same mixture computed
with every expert (what an implementation that runs all experts on every token reads), in
one run, alternating rounds.

Random weights (float32: both models then run the same PyTorch layers on a CPU) of a
Qwen3-MoE of 8 layers, hidden size 1024, 32 experts of 512 with 4 routed per token, and of a
dense Qwen3 whose MLP is those 4 experts' size (2048). Prompt 64 tokens, 64 new, first token
excluded.

    python benchmarks/moe.py [--rounds 3] [--device auto]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import CACHE, machine, random_prompt_decode_speed, save_results

from expresslane import LLM
from expresslane.models.moe import SparseMoE

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
EXPERTS, TOP_K, EXPERT_SIZE = 32, 4, 512
PROMPT, NEW = 64, 64


def checkpoint(name: str, config_cls: str, model_cls: str, **extra):
    import transformers

    out = CACHE / name
    if not (out / "model.safetensors").is_file():
        torch.manual_seed(0)
        cfg = getattr(transformers, config_cls)(**SHAPE, **extra)
        getattr(transformers, model_cls)(cfg).save_pretrained(out)
    return out


def every_expert(self: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The baseline: every expert on every token, the unrouted ones weighted 0."""
    weights, experts = self.route(x)
    dense = torch.zeros(x.shape[0], len(self.gate_up), dtype=x.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for e in range(len(self.gate_up)):
        out += self.expert(e, x) * dense[:, e : e + 1]
    return out


def decode_speed(llm: LLM) -> float:
    return random_prompt_decode_speed(llm, SHAPE["vocab_size"], PROMPT, NEW)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    moe_dir = checkpoint(
        "qwen3moe-32x512",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        intermediate_size=EXPERT_SIZE,
        moe_intermediate_size=EXPERT_SIZE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
    )
    dense_dir = checkpoint(
        "qwen3-dense-2048", "Qwen3Config", "Qwen3ForCausalLM", intermediate_size=TOP_K * EXPERT_SIZE
    )
    options = dict(dtype="float32", device=args.device, max_model_len=256)
    llms = {"moe": LLM(str(moe_dir), **options), "dense": LLM(str(dense_dir), **options)}
    routed = SparseMoE.forward
    speeds: dict[str, list[float]] = {"moe": [], "dense": [], "moe_every_expert": []}
    for llm in llms.values():
        decode_speed(llm)  # warm-up
    for _ in range(args.rounds):
        speeds["moe"].append(decode_speed(llms["moe"]))
        speeds["dense"].append(decode_speed(llms["dense"]))
        SparseMoE.forward = every_expert
        speeds["moe_every_expert"].append(decode_speed(llms["moe"]))
        SparseMoE.forward = routed
    median = {name: statistics.median(v) for name, v in speeds.items()}
    results = {
        "machine": machine(),
        "shape": {**SHAPE, "experts": EXPERTS, "top_k": TOP_K, "expert_size": EXPERT_SIZE},
        "decode_tok_s": median,
        "rounds": speeds,
        "moe_step_vs_dense": median["dense"] / median["moe"],
        "every_expert_step_vs_routed": median["moe"] / median["moe_every_expert"],
    }
    for name, value in median.items():
        print(f"{name}: {value:.1f} tok/s ({1000 / value:.2f} ms per step)")
    ratio, every = results["moe_step_vs_dense"], results["every_expert_step_vs_routed"]
    print(f"MoE step / dense step with the same active parameters: {ratio:.2f}")
    print(f"every expert / routed only: {every:.2f}x the step time")
    print(f"saved {save_results('moe', results)}")


if __name__ == "__main__":
    main()
