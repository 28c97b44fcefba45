"""Batch-1 decode against the memory-bandwidth roofline, on CPU or CUDA, same run.

A batch-1 decode step reads every weight the step multiplies by (all linear layers and the
output head; one row of the embedding table) plus the sequence's KV cache, so its best time
is those bytes over the memory's bandwidth. This measures the bandwidth on the spot (best
of several reads of a 1 GiB tensor, `sum`), the bytes from the model, and expresslane's
batch-1 decode tokens/s (prompt 128, 64 new tokens, first token excluded; median of rounds),
and reports decode tokens/s as a fraction of bandwidth / bytes per step.

Random weights of the SmolLM2-135M architecture (bf16) unless --model is given.

    python benchmarks/roofline.py [--device auto|cpu|cuda] [--rounds 5] [--model DIR]
                                  [--cuda-graphs]   # decode steps replayed from graphs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import SMOLLM2_135M, machine, model_vocab, random_checkpoint, save_results

PROMPT, NEW = 128, 64


def read_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second one full read of a large tensor achieves (best of `repeats`)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def bytes_per_step(engine, context: int) -> int:
    """Weight bytes a batch-1 decode step streams (in the storage the kernels read: the
    checkpoint dtype, here bf16) plus the KV cache of `context` tokens (in its store)."""
    cfg = engine.model_config
    ckpt_bytes = 2  # bf16 weights
    per_layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer += cfg.num_heads * cfg.head_dim * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    head = cfg.vocab_size * cfg.hidden_size
    return (cfg.num_layers * per_layer + head) * ckpt_bytes + engine.kv_bytes_per_token * context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=None, help="a bf16 Hugging Face checkpoint directory")
    ap.add_argument("--cuda-graphs", action="store_true", help="the engine's cuda_graphs")
    ap.add_argument("--name", default="roofline", help="the results file's name")
    args = ap.parse_args()

    from expresslane import LLM, SamplingParams

    path = args.model or str(random_checkpoint("smollm2-135m", SMOLLM2_135M))
    llm = LLM(path, device=args.device, max_model_len=1024, cuda_graphs=args.cuda_graphs)
    device = llm.engine.device
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, min(10_000, model_vocab(path)), (PROMPT,), generator=g).tolist()
    llm.generate([prompt], sp)  # warm-up (kernel builds, graph captures, caches)
    rates, bandwidths = [], []
    for _ in range(args.rounds):  # alternate the two so drift hits both alike
        bandwidths.append(read_bandwidth(device))
        rates.append(llm.generate([prompt], sp)[0].metrics["decode_tokens_per_s"])
    bandwidth = statistics.median(bandwidths)
    step_bytes = bytes_per_step(llm.engine, PROMPT + NEW // 2)
    roofline = bandwidth / step_bytes
    decode = statistics.median(rates)
    result = {
        "machine": machine(),
        "device": str(device),
        "cuda_graphs": args.cuda_graphs,
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "bytes_per_step_mb": round(step_bytes / 1e6, 1),
        "roofline_tok_s": round(roofline, 1),
        "decode_tok_s": round(decode, 1),
        "decode_tok_s_rounds": [round(r, 1) for r in rates],
        "fraction_of_roofline": round(decode / roofline, 3),
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    print(f"saved {save_results(args.name, result)}")


if __name__ == "__main__":
    main()
