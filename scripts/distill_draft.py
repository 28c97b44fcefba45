"""Sequence-level distillation of the bundled draft model from the bundled target.

Speculative decoding keeps a draft's guess when it is the target's own next token, so the
draft should learn the target's outputs, not the corpus: this script has the target write
greedy continuations of train-split prompts and fine-tunes the draft to predict them.

1. Prompts, from the train files only (the held-out ones stay unseen): headers of short
   functions (signature + docstring, as the `complete` workload of benchmarks/spec.py),
   windows of code files cut at a line end, edits (a function, then its first line again
   under a new name, as the `edit` workload) and chats of the training mix (30% instructions,
   15% code to complete, 10% questions, 45% tool use) cut before an assistant turn.
   `--prompts N` of them, mixed 40/25/15/20.
2. The target continues each greedily (expresslane's engine, batched), up to `--max-tokens`.
3. The draft (transformers LlamaForCausalLM, starting from its shipped weights) trains on
   prompt + continuation: cross-entropy on the target's tokens, plus `--prompt-weight` times the
   cross-entropy on the prompt's own tokens (real code: it keeps the draft's general modelling).
   AdamW, linear warmup, cosine decay, bf16 autocast where the CPU has bf16.
4. Before and after, the draft's agreement with the target (teacher-forced: the share of the
   target's greedy tokens that are the draft's argmax, the per-token acceptance of greedy
   speculation) on benchmarks/spec.py's held-out workloads.
5. `--out-dir`: the draft in Hugging Face format (bf16) with the target's tokenizer files,
   `draft_vocab.json`: the `--greedy-vocab` tokens most frequent in the training sequences
   (prompts and continuations), which the draft's greedy guesses are picked among
   (spec/draft.py), and `distill.json` (arguments, data, losses, agreement, wall time).
   `--vocab-only` writes the vocabulary for the draft in `--init` without training.

    python -m scripts.distill_draft --out-dir /tmp/draft_kd [--prompts 12000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from expresslane import LLM, SamplingParams
from expresslane.demo import DRAFT_DIR, TARGET_DIR, demo_model_dir
from scripts import eval_demo_model as E
from scripts import train_demo_model as T


def train_prompts(n: int, seed: int) -> list[str]:
    """n prompts from the train files: 40% function headers, 25% code windows, 15% edits,
    20% chats (a conversation of the training mix: instructions, code to complete, questions or
    tool use, cut before one of its assistant turns and rendered with the chat template)."""
    from transformers import AutoTokenizer

    root = T.stdlib_root()
    train, _, _ = T.split_files(T.list_corpus(root))
    sources = T.read_sources(root, train)
    rng = random.Random(f"{seed}-distill")
    functions = E.pick_functions(sources, 10**9, seed)
    counts = {"header": 4 * n // 10, "window": n // 4, "edit": 15 * n // 100}
    counts["chat"] = n - sum(counts.values())
    headers = [fn["header"] for fn in functions[: counts["header"]]]
    edits = E.edit_prompts(functions, counts["edit"])
    files = sorted(sources)
    windows = []
    while len(windows) < counts["window"]:
        lines = sources[rng.choice(files)].splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(len(lines) - 10)
        windows.append("".join(lines[start : start + rng.randint(8, 40)]))
    factory = T.ExampleFactory(sources)
    tok = AutoTokenizer.from_pretrained(demo_model_dir(TARGET_DIR))
    chats = []
    while len(chats) < counts["chat"]:
        r = rng.random()
        make = (
            factory.instruct
            if r < 0.3
            else factory.complete_chat
            if r < 0.45
            else factory.question
            if r < 0.55
            else factory.tool_use
        )
        messages, tools = make(rng)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        cut = rng.choice(turns)
        chats.append(
            tok.apply_chat_template(
                messages[:cut], tools=tools, tokenize=False, add_generation_prompt=True
            )
        )
    mix = headers + windows + edits + chats
    rng.shuffle(mix)
    return mix


def target_continuations(prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The target's greedy continuation of each prompt that fits its context with them."""
    llm = LLM(demo_model_dir(TARGET_DIR), max_batch=64, max_model_len=T.MAX_POSITIONS)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    encoded = [llm.tokenizer.encode(p) for p in prompts]
    fits = [ids for ids in encoded if len(ids) + max_tokens <= T.MAX_POSITIONS]
    pairs = []
    for i in range(0, len(fits), 256):
        chunk = fits[i : i + 256]
        for ids, out in zip(chunk, llm.generate(chunk, params), strict=True):
            pairs.append((ids, list(out.token_ids)))
        print(f"  generated {len(pairs)}/{len(fits)}", flush=True)
    return pairs


def agreement(model, pairs: list[tuple[list[int], list[int]]], vocab=None) -> float:
    """Share of the target's tokens that are the draft's argmax (among `vocab` if given),
    teacher-forced."""
    hits = total = 0
    with torch.no_grad():
        for prompt, out in pairs:
            ids = torch.tensor([prompt + out])
            logits = model(input_ids=ids[:, :-1]).logits[0, len(prompt) - 1 :]
            guess = logits.argmax(-1) if vocab is None else vocab[logits[:, vocab].argmax(-1)]
            hits += (guess == ids[0, len(prompt) :]).sum().item()
            total += len(out)
    return hits / max(total, 1)


def greedy_vocab(pairs: list[tuple[list[int], list[int]]], n: int) -> list[int]:
    """The n tokens most frequent in the sequences (ties: the lower id), sorted."""
    counts = Counter(t for prompt, out in pairs for t in prompt + out)
    return sorted(sorted(counts, key=lambda t: (-counts[t], t))[:n])


def heldout_pairs(max_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    workloads = E.spec_workloads(24)  # benchmarks/spec.py's own workloads
    return {name: target_continuations(p, max_tokens) for name, p in workloads.items()}


def batches(pairs, batch_tokens: int, rng: random.Random):
    order = list(range(len(pairs)))
    rng.shuffle(order)
    batch, longest = [], 0
    for i in order:
        n = len(pairs[i][0]) + len(pairs[i][1])
        if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(pairs[i])
        longest = max(longest, n)
    if batch:
        yield batch


def loss_of(model, batch, prompt_weight: float, pad: int) -> torch.Tensor:
    seqs = [p + o for p, o in batch]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad)
    weights = torch.zeros(len(seqs), width - 1)
    for b, ((prompt, _), s) in enumerate(zip(batch, seqs, strict=True)):
        ids[b, : len(s)] = torch.tensor(s)
        weights[b, : len(prompt) - 1] = prompt_weight  # predicting prompt tokens 1..
        weights[b, len(prompt) - 1 : len(s) - 1] = 1.0  # predicting the target's tokens
    logits = model(input_ids=ids[:, :-1]).logits.float()
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    return (ce * weights.reshape(-1)).sum() / weights.sum()


def train(model, data, args) -> list[float]:
    """Fine-tune `model` in place on the (prompt, continuation) pairs; the losses per step."""
    bf16 = T.cpu_has_fast_bf16()
    rng = random.Random(args.seed)
    epoch_batches = list(batches(data, args.batch_tokens, rng))
    steps = max(1, int(len(epoch_batches) * args.epochs))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_scale(step: int) -> float:  # linear warmup, cosine decay to 10% of the peak
        return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    model.train()
    losses = []
    start = time.time()
    for step in range(steps):
        if step and step % len(epoch_batches) == 0:
            epoch_batches = list(batches(data, args.batch_tokens, rng))
        batch = epoch_batches[step % len(epoch_batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, batch, args.prompt_weight, pad=0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            recent = sum(losses[-50:]) / len(losses[-50:])
            print(
                f"  step {step}/{steps} loss {recent:.3f} ({time.time() - start:.0f} s)", flush=True
            )
    model.eval()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--init", type=Path, default=None, help="the draft to start from (bundled)")
    ap.add_argument("--prompts", type=int, default=12000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--prompt-weight", type=float, default=0.1)
    ap.add_argument("--greedy-vocab", type=int, default=4096)
    ap.add_argument("--vocab-only", action="store_true", help="write draft_vocab.json only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    from transformers import LlamaForCausalLM

    init = args.init or demo_model_dir(DRAFT_DIR)
    start = time.time()
    print("target continuations of train prompts", flush=True)
    data = target_continuations(train_prompts(args.prompts, args.seed), args.max_tokens)
    vocab = greedy_vocab(data, args.greedy_vocab)
    print("target continuations of the held-out workloads", flush=True)
    held = heldout_pairs(args.max_tokens)
    gen_seconds = time.time() - start

    model = LlamaForCausalLM.from_pretrained(init, torch_dtype=torch.float32).eval()
    before = {k: round(agreement(model, v), 4) for k, v in held.items()}
    print("agreement before", before, flush=True)
    losses = [] if args.vocab_only else train(model, data, args)
    after = {k: round(agreement(model, v), 4) for k, v in held.items()}
    in_vocab = {k: round(agreement(model, v, torch.tensor(vocab)), 4) for k, v in held.items()}
    print("agreement after", after, "among the greedy vocabulary", in_vocab, flush=True)

    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    if not args.vocab_only:
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        for name in T.TOKENIZER_FILES:
            shutil.copy(init / name, out / name)
    note = "tokens most frequent in distill_draft.py's training sequences (see distill.json)"
    (out / "draft_vocab.json").write_text(json.dumps({"note": note, "token_ids": vocab}) + "\n")
    record = {
        "command": "python -m scripts.distill_draft " + " ".join(sys.argv[1:]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "train_sequences": len(data),
        "train_target_tokens": sum(len(o) for _, o in data),
        "train_prompt_tokens": sum(len(p) for p, _ in data),
        "steps": len(losses),
        "first_loss": round(sum(losses[:20]) / max(len(losses[:20]), 1), 4),
        "final_loss": round(sum(losses[-50:]) / max(len(losses[-50:]), 1), 4),
        "agreement_before": before,
        "agreement_after": after,
        "agreement_after_in_greedy_vocab": in_vocab,
        "greedy_vocab": len(vocab),
        "generation_seconds": round(gen_seconds, 1),
        "wall_seconds": round(time.time() - start, 1),
    }
    name = "distill_vocab.json" if args.vocab_only else "distill.json"
    (out / name).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
