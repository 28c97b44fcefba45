"""Token selection from a batch of logits: greedy, temperature, top-k, top-p, seeds.

Sampling uses the exponential race, argmax(p / E) with E ~ Exp(1), which draws exactly from p
without a cumulative sum or a host round trip. A request with a seed owns a generator, so its
draws do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expresslane.engine.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict] | None = None  # per row: {"token": lp, "top": [(id, lp), ...]} or None


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and top-p nucleus. top_k <= 0 and
    top_p >= 1 leave a row unfiltered."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (a token is dropped when the mass
    # before it already reaches top_p); the first token always stays
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def generator_for(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        if req.generator is None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return req.generator

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
        """logits: float32 [B, V], one row per request."""
        raw = logits
        logits = self._mask_early_stops(logits, reqs)
        greedy = [r.params.greedy for r in reqs]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, reqs, greedy)
        token_list = tokens.tolist()
        logprobs = None
        if any(r.params.logprobs is not None for r in reqs):
            logprobs = self._logprobs(raw, token_list, reqs)
        return SampleResult(token_list, logprobs)

    def _mask_early_stops(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [
            (i, sorted(r.min_tokens_ids))
            for i, r in enumerate(reqs)
            if r.num_output_tokens < r.params.min_tokens and r.min_tokens_ids
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for i, ids in rows:
            logits[i, ids] = float("-inf")
        return logits

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], greedy: list[bool]
    ) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor(
            [1.0 if g else r.params.temperature for r, g in zip(reqs, greedy)], device=dev
        )
        scaled = logits / temps.unsqueeze(1)
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in reqs):
            top_k = torch.tensor([r.params.top_k for r in reqs], device=dev)
            top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.ones_like(probs)
        for i, r in enumerate(reqs):
            if not greedy[i]:
                noise[i].exponential_(generator=self.generator_for(r))
        sampled = (probs / noise).argmax(dim=-1)
        greedy_mask = torch.tensor(greedy, device=dev)
        return torch.where(greedy_mask, logits.argmax(dim=-1), sampled)

    def _logprobs(
        self, logits: torch.Tensor, tokens: list[int], reqs: list[Request]
    ) -> list[dict | None]:
        lp = logits.log_softmax(dim=-1)
        out: list[dict | None] = []
        for i, r in enumerate(reqs):
            n = r.params.logprobs
            if n is None:
                out.append(None)
                continue
            entry = {"token": lp[i, tokens[i]].item(), "top": []}
            if n > 0:
                vals, ids = lp[i].topk(n)
                entry["top"] = list(zip(ids.tolist(), vals.tolist()))
            out.append(entry)
        return out
