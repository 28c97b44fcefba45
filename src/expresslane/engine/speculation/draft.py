"""Draft-model proposer: a small model with the target's tokenizer guesses the next tokens one
at a time, batched over the requests that speculate.

The draft keeps its own paged KV pool (its own blocks and prefix cache, on the target's block
size) and a shadow sequence per request. Before each proposal the shadow is synced with the
request: its KV stays valid for the tokens the target accepted and is trimmed past them, then
the draft catches up on the tokens it has not seen (the whole prompt the first time, usually
one or two tokens after that) and guesses. A preempted request keeps its draft KV, since
preemption drops only the target's.

A draft folder may hold `draft_vocab.json` ({"token_ids": [...]}): greedy guesses are then
picked among those tokens only (the ones the target is seen to write), so the draft's output
head reads that many rows instead of the whole vocabulary's; the bundled draft keeps 4,096 of
8,192 (scripts/distill_draft.py writes the file). Any guess is verified exactly, so this only
changes which guesses are made. Sampled requests draw from the draft's full distribution.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.request import Request
from expresslane.engine.runner import CacheConfig, ModelRunner
from expresslane.engine.sampler import greedy_tokens
from expresslane.engine.speculation.proposal import Proposal
from expresslane.errors import ModelLoadError
from expresslane.models import load_model
from expresslane.models.loader import read_checkpoint
from expresslane.sampling_params import SamplingParams

log = logging.getLogger("expresslane.spec")

_SEED_SALT = 0x5BD1E995  # the draft's draws must not repeat the target's verification draws
NATIVE_CATCH_UP = 64  # unseen tokens the native loop takes; more go through a prompt chunk
GREEDY_VOCAB_FILE = "draft_vocab.json"


class Shadow(Request):
    """The draft's copy of a request: the same tokens, followed by the draft's guesses."""

    def __init__(self, req: Request):
        p = req.params
        seed = None if p.seed is None else (p.seed ^ _SEED_SALT) & 0x7FFFFFFF
        params = SamplingParams(
            max_tokens=None, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed
        )
        super().__init__(
            req.request_id, req.token_ids, params, max_tokens=1, cache_salt=req.cache_salt
        )
        self.synced = len(req.token_ids)  # the request's length when last synced


class DraftModelProposer:
    free = False  # every guess costs a draft step: the engine sizes proposals beforehand

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: torch.dtype,
        linear_dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        target_vocab_size: int,
        seed: int | None = None,
    ):
        self.model, self.cfg = load_model(model_dir, dtype, device, max_model_len, linear_dtype)
        if self.cfg.vocab_size > target_vocab_size:
            raise ModelLoadError(
                f"draft model {model_dir} has a vocabulary of {self.cfg.vocab_size} tokens, more "
                f"than the target's {target_vocab_size}: it must share the target's tokenizer"
            )
        self.vocab = target_vocab_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
        self.runner = ModelRunner(self.model, CacheConfig(num_blocks, block_size), seed)
        self.seqs: dict[str, Shadow] = {}
        self.greedy_vocab = self._load_greedy_vocab(Path(model_dir), dtype)

    def _load_greedy_vocab(self, model_dir: Path, dtype: torch.dtype) -> torch.Tensor | None:
        """The token ids greedy guesses are picked among (GREEDY_VOCAB_FILE), or None: all."""
        path = model_dir / GREEDY_VOCAB_FILE
        if not path.is_file():
            return None
        try:
            ids = sorted(set(json.loads(path.read_text())["token_ids"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f'{path}: expected {{"token_ids": [ints]}} ({e})') from e
        if not ids or not all(isinstance(t, int) and 0 <= t < self.cfg.vocab_size for t in ids):
            raise ModelLoadError(f"{path}: token ids must be in [0, {self.cfg.vocab_size})")
        vocab = torch.tensor(ids)
        if self.model.plan.native_head:
            # a tied head is the embeddings, already loaded; an untied one is read again
            tied = self.cfg.tie_word_embeddings
            head = self.model.embed if tied else read_checkpoint(model_dir).get("lm_head.weight")
            if isinstance(head, torch.Tensor) and head.is_floating_point():  # not FP4 codes
                # the native head's kernel reads bf16 rows (as the draft's bf16 linears)
                self.model.set_greedy_vocab(head[vocab].to(torch.bfloat16), vocab, dtype)
        return vocab

    def release(self, request_id: str) -> None:
        shadow = self.seqs.pop(request_id, None)
        if shadow is not None:
            self.kv.release(shadow)

    def propose(self, requests: list[Request], lengths: list[int]) -> list[Proposal]:
        shadows = [self._sync(r) for r in requests]
        greedy = [r.params.greedy for r in requests]
        if all(greedy) and self._greedy_native(shadows, lengths):
            return [
                Proposal(s.token_ids[len(s.token_ids) - n :], None)
                for s, n in zip(shadows, lengths, strict=True)
            ]
        guesses: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        index = {id(s): i for i, s in enumerate(shadows)}
        while active:
            items = []
            for i in active:
                s = shadows[i]
                if self.kv.allocate(s, s.num_tokens):
                    items.append((s, s.num_tokens - s.num_computed_tokens))
            if not items:
                break
            input_ids, positions, meta, rows, samples = self.runner.prepare(items)
            logits = self.model(input_ids, positions, meta, rows)
            order = [index[id(s)] for s, _ in samples]
            tokens, q = self._choose(logits, [shadows[i] for i in order], greedy, order)
            for row, i in enumerate(order):
                s = shadows[i]
                s.num_computed_tokens = s.num_tokens  # the new guess itself is not computed
                s.token_ids.append(tokens[row])
                guesses[i].append(tokens[row])
                if q is not None and not greedy[i]:
                    probs[i].append(q[row])
            active = [i for i in order if len(guesses[i]) < lengths[i]]
        return [
            Proposal(g, torch.stack(p) if p else None) for g, p in zip(guesses, probs, strict=True)
        ]

    def _greedy_native(self, shadows: list[Shadow], lengths: list[int]) -> bool:
        """Every guess of every shadow in one native call, when each has only a few unseen
        tokens (the usual case after the first proposal: the accepted guesses and the target's
        own token). False if unavailable or out of blocks: the step loop runs instead."""
        if (
            not shadows
            or not self.model.plan.native_head
            or any(s.num_tokens - s.num_computed_tokens > NATIVE_CATCH_UP for s in shadows)
        ):
            return False
        steps = max(lengths)
        if not all(self.kv.allocate(s, s.num_tokens + steps - 1) for s in shadows):
            return False
        starts = [s.num_computed_tokens for s in shadows]
        slots = self.runner.padded_slots(shadows, max(s.num_tokens for s in shadows) + steps - 1)
        tokens = self.model.greedy(
            [s.token_ids[s.num_computed_tokens :] for s in shadows],
            starts,
            [s.num_prompt_tokens for s in shadows],
            torch.from_numpy(slots),
            steps,
        )
        for s, row, n in zip(shadows, tokens.tolist(), lengths, strict=True):
            s.num_computed_tokens = s.num_tokens + n - 1  # all but the last guess
            s.token_ids.extend(row[:n])
        return True

    def _choose(self, logits, shadows, greedy, order):
        """Greedy rows take the argmax; sampled rows draw from the draft's own q (same
        temperature and filters as the request), which verification needs."""
        logits = logits[:, : self.cfg.vocab_size].float()
        if self.cfg.vocab_size < self.vocab:  # tokens the draft cannot propose
            pad = logits.new_full((logits.shape[0], self.vocab - self.cfg.vocab_size), -torch.inf)
            logits = torch.cat([logits, pad], dim=1)
        if self.greedy_vocab is None:
            tokens = greedy_tokens(logits)
        else:  # as the native loop: the argmax among the greedy vocabulary
            tokens = self.greedy_vocab[greedy_tokens(logits.index_select(1, self.greedy_vocab))]
        sampled = [row for row, i in enumerate(order) if not greedy[i]]
        if not sampled:
            return tokens.tolist(), None
        sampler = self.runner.sampler
        q = torch.zeros_like(logits)
        rows = [shadows[row] for row in sampled]
        q[sampled] = sampler.probs(logits[sampled], rows)
        tokens[sampled] = sampler.draw(q[sampled], rows)
        return tokens.tolist(), q

    def _sync(self, req: Request) -> Shadow:
        s = self.seqs.get(req.request_id)
        if s is None:
            s = self.seqs[req.request_id] = Shadow(req)
            s.num_computed_tokens = self.kv.acquire_prefix(s)
            return s
        # The request grew by the guesses the target accepted plus one token of its own;
        # the draft's KV holds at most the tokens the two agree on.
        valid = s.synced
        new = req.token_ids
        while valid < min(len(new), s.num_tokens) and new[valid] == s.token_ids[valid]:
            valid += 1
        valid = min(valid, s.num_computed_tokens, len(new) - 1)
        del s.token_ids[valid:]
        s.token_ids.extend(new[valid:])
        s.synced = len(new)
        s.num_computed_tokens = valid
        self.kv.trim(s, valid)
        # Only now, with guesses rolled back, may full blocks enter the prefix cache: a block
        # registered while it held guesses could be overwritten after a rejection.
        self.kv.cache_full_blocks(s)
        return s
