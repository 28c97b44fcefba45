"""The logit adjustments clients ask for, applied to the whole batch on the device before a
token is picked (greedy rows too), in vLLM's order and with its semantics:

1. `logit_bias` (OpenAI): the bias is added to the token's logit.
2. `repetition_penalty` (vLLM / Hugging Face): a token seen in the prompt or the output so
   far has a positive logit divided by it, a negative one multiplied.
3. `frequency_penalty` and `presence_penalty` (OpenAI): a token's logit is lowered by
   frequency_penalty * its count in the output so far, plus presence_penalty if it is there.

Then the sampler takes temperature, `min_p`, `top_k` and `top_p` (engine/sampler.py).

"The output so far" of a row that scores position j of a speculative guess window is the
request's output plus its first j guesses, the history that row's token follows if it is
kept: greedy tokens are then the same with and without speculation.
"""

from __future__ import annotations

import torch

from expresslane.engine.request import Request


def apply_penalties(
    logits: torch.Tensor, reqs: list[Request], offsets: list[int] | None = None
) -> torch.Tensor:
    """`logits` [rows, vocab] with each row's adjustments; the same tensor when no row has any
    (the usual case costs one attribute check per row)."""
    rows = [i for i, r in enumerate(reqs) if r.params.adjusts_logits]
    if not rows:
        return logits
    sub_reqs = [reqs[i] for i in rows]
    sub_offsets = [0] * len(rows) if offsets is None else [offsets[i] for i in rows]
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    _add_bias(sub, sub_reqs)
    if any(_penalized(r) for r in sub_reqs):
        sub = _penalize(sub, sub_reqs, sub_offsets)
    return logits.index_copy(0, index, sub)


def _penalized(req: Request) -> bool:
    p = req.params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _add_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    rows, ids, biases = [], [], []
    for i, r in enumerate(reqs):
        for token, bias in (r.params.logit_bias or {}).items():
            rows.append(i)
            ids.append(token)
            biases.append(bias)
    if rows:
        dev = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
            torch.tensor(biases, dtype=logits.dtype, device=dev),
            accumulate=True,
        )


def token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float32: how often each token occurs in each sequence."""
    counts = torch.zeros(len(seqs), vocab, device=device)
    flat = [i * vocab + t for i, seq in enumerate(seqs) for t in seq]
    if flat:
        index = torch.tensor(flat, device=device)
        counts.view(-1).scatter_add_(0, index, torch.ones(len(flat), device=device))
    return counts


def _penalize(logits: torch.Tensor, reqs: list[Request], offsets: list[int]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[1]
    # each request's counts once (a verification window has several rows), then each row
    # adds the guesses before it
    owner: dict[int, int] = {}
    for r in reqs:
        owner.setdefault(id(r), len(owner))
    unique = list({id(r): r for r in reqs}.values())
    row_owner = torch.tensor([owner[id(r)] for r in reqs], device=dev)
    counts = token_counts([r.output_token_ids for r in unique], vocab, dev)[row_owner]
    guesses = [r.spec.guesses[:j] for r, j in zip(reqs, offsets, strict=True)]
    if any(guesses):
        counts += token_counts(guesses, vocab, dev)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in reqs], device=dev).unsqueeze(1)

    if any(r.params.repetition_penalty != 1.0 for r in reqs):
        prompts = [r.token_ids[: r.num_prompt_tokens] for r in unique]
        seen = (token_counts(prompts, vocab, dev) > 0)[row_owner] | (counts > 0)
        scale = torch.where(seen, column("repetition_penalty"), 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    return (
        logits
        - column("frequency_penalty") * counts
        - column("presence_penalty") * (counts > 0).to(logits.dtype)
    )
