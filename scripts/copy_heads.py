"""Copy heads: teach a small model to copy from its context by supervising three attention heads.

A model trained for an hour on a CPU never forms induction heads on its own (MODEL_CARD.md,
"Copying"): the circuit needs a previous-token head and a matching head at once, and neither
pays off alone, so the loss stays on a plateau far longer than such a run lasts. Here the
attention patterns of the circuit are named as training targets, so both parts learn at once:

- layer 0, head 0 looks at the previous token (t-1);
- layer 0, the first head of the second KV group looks two tokens back (t-2);
- layer 1, head 0 looks at the token that followed the last two tokens' earlier occurrences:
  at t, the positions s+1 with (x[s-1], x[s]) == (x[t-1], x[t]), s < t (an induction head
  keyed on two tokens, precise enough to follow a copied span).

The loss of a head is -log(attention mass on its allowed keys), averaged over the queries
that have one. It needs eager attention (`output_attentions`). Rows of random tokens, each a
span, a gap and the span again, with the loss on the repeat only, teach the rest of the
circuit: to output the token the induction head attends to. The weights stay an ordinary
Llama checkpoint; nothing in the serving engine knows about this.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

COPY_ROWS = 8  # random-token copy rows per step
COPY_ROW_LEN = 128  # tokens per copy row (+1 for the shifted labels)
COPY_SPAN = (16, 56)  # the repeated span's length, drawn uniformly
COPY_TOKENS = (100, 8192)  # ids drawn for the rows (past the special and byte-pair seeds)
SUPERVISION_WEIGHT = 1.0  # weight of the attention losses against the language-model loss


def copy_rows(rng: random.Random, n: int = COPY_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n, COPY_ROW_LEN + 1], labels [n, COPY_ROW_LEN]): span, random gap, span again;
    labels are -100 except on the repeat past its first token."""
    rows, labels = [], []
    total = COPY_ROW_LEN + 1
    for _ in range(n):
        k = rng.randint(*COPY_SPAN)
        span = [rng.randrange(*COPY_TOKENS) for _ in range(k)]
        gap = [rng.randrange(*COPY_TOKENS) for _ in range(total - 2 * k)]
        row = span + gap + span
        repeat = total - k  # index of the repeat's first token
        labels.append([-100] * repeat + row[repeat + 1 :])
        rows.append(row)
    return torch.tensor(rows), torch.tensor(labels)


def head_targets(ids: torch.Tensor, num_heads: int, num_kv_heads: int) -> list[tuple]:
    """[(layer, head, allowed keys [B or 1, T, T] bool)] for input ids [B, T]."""
    T = ids.shape[1]
    prev = torch.diag(torch.ones(T - 1, dtype=torch.bool), -1)[None]
    prev2 = torch.diag(torch.ones(T - 2, dtype=torch.bool), -2)[None]
    same = ids[:, :, None] == ids[:, None, :]  # [B, t, s]
    pair = same.clone()
    pair[:, 1:, 1:] &= same[:, :-1, :-1]  # x[t-1] == x[s-1] too
    pair[:, 0] = False
    pair[:, :, 0] = False
    pair &= torch.ones(T, T, dtype=torch.bool).tril(-1)  # s < t
    induction = torch.zeros_like(pair)
    induction[:, :, 1:] = pair[:, :, :-1]  # attend s+1
    second_group = num_heads // num_kv_heads
    return [(0, 0, prev), (0, second_group, prev2), (1, 0, induction)]


def attention_loss(attentions, targets: list[tuple]) -> torch.Tensor:
    """Sum over the supervised heads of -log(attention mass on the allowed keys)."""
    total = 0.0
    for layer, head, allowed in targets:
        probs = attentions[layer][:, head].float()
        mass = (probs * allowed).sum(-1)
        has = allowed.any(-1).expand_as(mass)
        total = total + -mass[has].clamp_min(1e-6).log().mean()
    return total


def copy_loss(model, ids: torch.Tensor, attentions, rng: random.Random, autocast) -> tuple:
    """(loss to add, copy-row LM loss, attention loss) for a step whose data batch (input ids
    `ids`) ran with `output_attentions`: the attention losses on that batch and on fresh copy
    rows, plus the copy rows' language-model loss."""
    cfg = model.config
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
    rows, labels = copy_rows(rng)
    rows, labels = rows.to(ids.device), labels.to(ids.device)
    with autocast:
        out = model(input_ids=rows[:, :-1], output_attentions=True)
    lm = F.cross_entropy(out.logits.float().reshape(-1, cfg.vocab_size), labels.reshape(-1))
    attn = attention_loss(attentions, head_targets(ids, *heads))
    attn = attn + attention_loss(out.attentions, head_targets(rows[:, :-1], *heads))
    return lm + SUPERVISION_WEIGHT * attn, lm, attn
