"""Does a model copy from its context? Two probes of the demo target (transformers, fp32):

- code: a held-out function, three newlines, then the same function renamed `name_v2`; the mean
  loss on the repeat (past its first 8 tokens) against the loss on the original. A model that
  copies predicts the repeat almost for free.
- random: 8 sequences of 60 random token ids, each followed by itself; the loss on the second
  copy against the first. This is the classic test for induction heads, which prompt-lookup
  speculation (and copying a requested path into a tool call) rides on.

    python -m scripts.copy_probe [MODEL_DIR ...]    # default: the bundled target
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from scripts import eval_demo_model as E


def token_losses(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
    return -logprobs.gather(2, ids[:, 1:, None])[..., 0]


def code_probe(model, tok, n: int = 16) -> tuple[float, float]:
    functions = E.pick_functions(E.heldout_sources(), 5 * n, 0)
    first, repeat = [], []
    for source, edited in E.edit_pairs(functions, n):
        a = tok(source + "\n\n\n", add_special_tokens=False).input_ids
        b = tok(edited, add_special_tokens=False).input_ids
        nll = token_losses(model, torch.tensor([a + b]))[0]
        first.append(nll[: len(a) - 1].mean().item())
        repeat.append(nll[len(a) - 1 + 8 :].mean().item())
    return sum(first) / len(first), sum(repeat) / len(repeat)


def random_probe(model, vocab: int, length: int = 60) -> tuple[float, float]:
    seq = torch.randint(100, vocab, (8, length), generator=torch.Generator().manual_seed(0))
    nll = token_losses(model, torch.cat([seq, seq], 1))
    return nll[:, : length - 1].mean().item(), nll[:, length + 1 :].mean().item()


def main() -> None:
    dirs = sys.argv[1:] or [str(E.T.DEFAULT_OUT / "target")]
    for d in dirs:
        tok = AutoTokenizer.from_pretrained(d)
        model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        code = code_probe(model, tok)
        rand = random_probe(model, model.config.vocab_size)
        print(
            f"{d}: held-out function {code[0]:.2f} nats/token, its repeat {code[1]:.2f}; "
            f"random tokens {rand[0]:.2f}, their repeat {rand[1]:.2f}"
        )


if __name__ == "__main__":
    main()
