"""Logprobs of the prompt's own tokens (vLLM's `prompt_logprobs`; Completions' `echo` with
`logprobs`): the logits at position p score prompt token p + 1.

The runner asks the model for the logits of those positions in each prompt chunk it computes,
besides the rows it samples; chunks add up to the whole prompt. Entries are appended to
`Request.prompt_logprobs` once, in order: a chunk computed again (after a preemption, or when
fault isolation runs a step again) adds only the positions not there yet. Such requests take
no prefix-cache hits (kv_cache.py), so every prompt position is computed at least once.
"""

from __future__ import annotations

import torch

from expresslane.engine.request import Request

PromptRows = list[tuple[Request, int, int]]  # (request, first position, positions)


def wanted(req: Request, start: int, end: int) -> range:
    """The positions of start..end-1 whose logits `req` still needs (often none)."""
    done = req.prompt_logprobs
    if done is None:
        return range(0)
    first = len(done) - 1  # the position that scores the next missing prompt token
    if first < start:
        return range(0)  # not reached by this chunk (cannot happen: chunks come in order)
    return range(first, min(end, req.num_prompt_tokens - 1))


def record(logits: torch.Tensor, parts: PromptRows) -> None:
    """Append the entries of `parts` ({"token": lp, "top": [(id, lp), ...]}, as sampled
    tokens' logprobs) from their logits rows, in order."""
    lp = logits.log_softmax(dim=-1)
    targets = [t for req, first, n in parts for t in req.token_ids[first + 1 : first + 1 + n]]
    index = torch.tensor(targets, device=lp.device).unsqueeze(1)
    token_lp = lp.gather(1, index).squeeze(1).tolist()
    top_n = max(req.params.prompt_logprobs for req, _, _ in parts)
    top_ids: list[list[int]] = [[] for _ in targets]
    top_lp: list[list[float]] = [[] for _ in targets]
    if top_n:
        values, ids = lp.topk(top_n, dim=-1)
        top_ids, top_lp = ids.tolist(), values.tolist()
    row = 0
    for req, _, n in parts:
        k = req.params.prompt_logprobs
        for _ in range(n):
            top = list(zip(top_ids[row][:k], top_lp[row][:k]))
            req.prompt_logprobs.append({"token": token_lp[row], "top": top})
            row += 1
