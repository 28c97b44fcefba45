"""Speculation with a draft model, and with sampling: greedy outputs stay token-identical, and
sampled outputs keep the target's distribution (chi-square tests at fixed contexts)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2_contingency, chisquare

from expresslane import LLM, SamplingParams
from expresslane.engine.request import Request
from expresslane.engine.sampler import Sampler
from expresslane.engine.speculation.draft import GREEDY_VOCAB_FILE
from expresslane.errors import ModelLoadError

from .conftest import bf16_copy, random_prompts


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory):
    """The target's weights plus noise: a draft that agrees with it part of the time."""
    out = tmp_path_factory.mktemp("draft") / "llama-draft"
    shutil.copytree(llama_dir, out)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    noisy = {
        k: v + 0.6 * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype)
        for k, v in weights.items()
    }
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _spec(draft_dir, k=4):
    return {"method": "draft", "model": str(draft_dir), "num_tokens": k, "max_batch": None}


@pytest.mark.parametrize("weights", ["float32", "bf16"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("max_batch", [1, 8])
def test_greedy_outputs_identical_on_100_prompts(
    llama_dir, llama_bf16_dir, draft_dir, method, max_batch, weights
):
    """float32 runs the Python layers; bf16 (the CPU default for bf16 checkpoints) the native
    step, for verifications of 8 x 5 rows and prompt chunks beside decodes too."""
    prompts = [p + p[:8] for p in random_prompts(100, 4, 32, seed=41)]  # n-grams to look up
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    target = str(llama_dir if weights == "float32" else llama_bf16_dir)
    opts = dict(max_batch=max_batch, dtype="float32" if weights == "float32" else "auto")
    plain_llm = LLM(target, **opts)
    if weights == "bf16" and not plain_llm.engine.model.plan.every_step:
        pytest.skip("row-invariant steps need the AVX-512 BF16 kernels")
    plain = plain_llm.generate(prompts, params)
    spec = _spec(draft_dir)
    if method == "ngram":
        spec = {"method": "ngram", "num_tokens": 4, "max_batch": None}
    llm = LLM(target, speculative=spec, **opts)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.engine.speculation.stats
    assert 0 < stats.accepted < stats.proposed  # some guesses kept, some rolled back
    if method == "draft":
        draft = llm.engine.speculation.proposers["default"].proposer
        assert not draft.seqs and draft.kv.num_free_blocks == draft.kv.num_blocks
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_draft_model_state_survives_preemption_and_abort(llama_dir, draft_dir):
    prompts = random_prompts(12, 20, 60, seed=42)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir), dtype="float32").generate(prompts, params)
    llm = LLM(str(llama_dir), dtype="float32", speculative=_spec(draft_dir), num_kv_blocks=24)
    engine = llm.engine
    reqs = [engine.add_request(p, params) for p in prompts]
    victim = engine.add_request(prompts[0], params)
    for _ in range(5):
        engine.step()
    engine.abort(victim.request_id)
    while engine.has_unfinished():
        engine.step()
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in plain]
    draft = engine.speculation.proposers["default"].proposer
    assert not draft.seqs and draft.kv.num_free_blocks == draft.kv.num_blocks


def _with_greedy_vocab(draft_dir, tmp_path):
    """A bf16 copy of the draft whose greedy guesses are picked among every third token."""
    out = bf16_copy(draft_dir, tmp_path / "draft-vocab")
    vocab = list(range(0, json.loads((out / "config.json").read_text())["vocab_size"], 3))
    (out / GREEDY_VOCAB_FILE).write_text(json.dumps({"token_ids": vocab}))
    return out, set(vocab)


# unequal lengths: sequences catch up one at a time; equal: as one batch
@pytest.mark.parametrize("lengths", [[4, 2, 5, 1, 4], [3, 3, 3, 3, 3]])
@pytest.mark.parametrize("restricted", [False, True])
def test_native_draft_loop_proposes_what_the_step_loop_does(
    tmp_path, llama_dir, draft_dir, lengths, restricted
):
    """bf16 weights put the draft on the native decode step, whose greedy loop catches up on
    the unseen tokens and makes every guess in one call; its guesses must be the Python step
    loop's, also after the target accepted part of them (KV trimmed and caught up), and with
    a greedy vocabulary (draft_vocab.json) they are its tokens only, in both loops."""
    target = bf16_copy(llama_dir, tmp_path / "target")
    vocab = None
    if restricted:
        folder, vocab = _with_greedy_vocab(draft_dir, tmp_path)
    else:
        folder = bf16_copy(draft_dir, tmp_path / "draft")
    llm = LLM(str(target), speculative=_spec(folder))
    draft = llm.engine.speculation.proposers["default"].proposer
    assert draft.model.plan.native_head
    plan = draft.model.plan
    prompts = random_prompts(5, 4, 40, seed=43)

    def rounds(native: bool) -> list[list[int]]:
        draft.model.plan = dataclasses.replace(plan, native_head=native)
        greedy = SamplingParams(temperature=0)
        reqs = [Request(f"r{i}", list(p), greedy, max_tokens=64) for i, p in enumerate(prompts)]
        out = []
        for _ in range(3):
            proposals = draft.propose(reqs, lengths)
            out += [p.token_ids for p in proposals]
            for r, p in zip(reqs, proposals, strict=True):  # accept half, then a token of its own
                r.token_ids.extend(p.token_ids[: len(p.token_ids) // 2] + [7])
        for r in reqs:
            draft.release(r.request_id)
        assert draft.kv.num_free_blocks == draft.kv.num_blocks
        return out

    calls = []
    native_head = draft.model.greedy
    draft.model.greedy = lambda *args: calls.append(args) or native_head(*args)
    fast = rounds(native=True)
    assert len(calls) >= 2  # rounds 2 and 3 at least (round 1 catches up on whole prompts)
    assert fast == rounds(native=False)
    if vocab is not None:
        assert {t for guesses in fast for t in guesses} <= vocab


@pytest.mark.parametrize("max_batch", [1, 8])
def test_greedy_vocab_keeps_outputs_identical(tmp_path, llama_bf16_dir, draft_dir, max_batch):
    """Guesses from a restricted vocabulary are still verified exactly: the same tokens as
    plain decoding, and some guesses kept."""
    target = llama_bf16_dir
    folder, _ = _with_greedy_vocab(draft_dir, tmp_path)
    prompts = random_prompts(16, 4, 32, seed=44)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain_llm = LLM(str(target), max_batch=max_batch)
    if max_batch > 1 and not plain_llm.engine.model.plan.every_step:
        pytest.skip("batches are row-invariant with the AVX-512 BF16 kernels only")
    plain = plain_llm.generate(prompts, params)
    llm = LLM(str(target), speculative=_spec(folder), max_batch=max_batch)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.speculation.stats.accepted > 0


@pytest.mark.parametrize("content", ["[1, 2]", '{"token_ids": [1, -2]}', '{"ids": [1]}', "{"])
def test_a_bad_greedy_vocab_file_is_a_clear_load_error(tmp_path, draft_dir, content):
    folder = bf16_copy(draft_dir, tmp_path / "draft")
    (folder / GREEDY_VOCAB_FILE).write_text(content)
    with pytest.raises(ModelLoadError, match=GREEDY_VOCAB_FILE):
        LLM(str(bf16_copy(draft_dir, tmp_path / "target")), speculative=_spec(folder))


class _Row(Request):
    def __init__(self, guess: int, q: torch.Tensor | None, seed: int):
        super().__init__("r", [1], SamplingParams(temperature=1.0, seed=seed), max_tokens=8)
        self.spec.guesses = [guess]
        self.spec.guess_probs = None if q is None else q.unsqueeze(0)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_rejection_sampling_draws_exactly_from_the_target(proposer):
    """Sampler level: 20,000 verifications of a guess drawn from q against target p; the
    kept-or-resampled token must follow p (goodness of fit against the exact p)."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 12, 20_000
    p_logits = torch.randn(vocab, generator=g) * 1.5
    p = p_logits.softmax(-1)
    q = (torch.randn(vocab, generator=g) * 1.5).softmax(-1)
    if proposer == "draft":
        guesses = torch.multinomial(q, n, replacement=True, generator=g).tolist()
        reqs = [_Row(d, q, seed=i) for i, d in enumerate(guesses)]
    else:  # a deterministic guess: q is one-hot
        reqs = [_Row(int(p.argmin()), None, seed=i) for i in range(n)]
    tokens = Sampler(torch.device("cpu"), seed=0)(p_logits.expand(n, vocab), reqs, [0] * n)
    expected = p.double().numpy()
    expected *= n / expected.sum()
    counts = np.bincount(tokens.token_ids, minlength=vocab)
    assert chisquare(counts, expected).pvalue > 0.01
    if proposer == "draft":  # and the test has power: keeping every guess would follow q
        assert chisquare(np.bincount(guesses, minlength=vocab), expected).pvalue < 1e-6


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_sampled_outputs_follow_the_target_distribution(llama_dir, draft_dir, method):
    """End to end: 600 seeded samples of the first four output tokens at a fixed prompt,
    plain vs speculative; a chi-square test per position cannot tell them apart."""
    head = random_prompts(1, 12, 13, seed=43)[0]
    plain_llm = LLM(str(llama_dir), dtype="float32")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    path = plain_llm.generate(head, greedy)[0].token_ids
    # The model's own greedy path, then its start again: n-gram guesses follow that path.
    prompt = head + path + head
    n = 600
    spec = {"method": method, "num_tokens": 3, "max_batch": None}
    if method == "draft":
        spec = _spec(draft_dir, k=3)
    spec["adaptive"] = False  # guess at every step (the float32 test model makes it slower)

    def sample(llm, first_seed):
        params = [
            SamplingParams(max_tokens=4, temperature=0.7, top_k=6, seed=first_seed + i)
            for i in range(n)
        ]
        return np.array([o.token_ids for o in llm.generate([prompt] * n, params)])

    plain = sample(plain_llm, 0)
    # one request at a time: in a batch, most sampled requests leave the greedy path that
    # n-gram guesses follow, and the batch's common guess count (engine/guesses.py) is
    # then mostly 0
    llm = LLM(str(llama_dir), dtype="float32", speculative=spec, max_batch=1)
    speculative = sample(llm, 10_000)
    assert llm.engine.speculation.stats.accepted > (100 if method == "draft" else 20)
    for pos in range(1, 4):
        values = np.union1d(plain[:, pos], speculative[:, pos])
        table = [[np.sum(arm[:, pos] == v) for v in values] for arm in (plain, speculative)]
        assert chi2_contingency(table).pvalue > 0.01, pos
