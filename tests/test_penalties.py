"""Penalties and logit_bias (engine/penalties.py) against a plain PyTorch reference,
with and without speculation; prompt logprobs (engine/prompt_logprobs.py) against
transformers' own log-softmax."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.engine.penalties import apply_penalties
from expresslane.engine.request import Request
from expresslane.engine.submission import Submission
from expresslane.errors import InvalidRequestError

from .conftest import VOCAB, random_prompts

transformers = pytest.importorskip("transformers")
GREEDY = dict(temperature=0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_tokens": 4, "max_batch": None}


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams):
    """The adjustments written out token by token: logit_bias, then repetition_penalty over
    the prompt and output, then frequency and presence penalties over the output."""
    logits = logits.clone()
    for token, bias in (p.logit_bias or {}).items():
        logits[token] += bias
    for token in set(prompt) | set(output):
        x = logits[token]
        logits[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for token in set(output):
        logits[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return logits


@pytest.fixture(scope="module")
def hf(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=32)  # chunked prompts


def reference_greedy(hf, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(reference(logits, prompt, out, params).argmax()))
    return out


CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "negative-frequency": dict(frequency_penalty=-0.6, presence_penalty=-0.4),
    "repetition": dict(repetition_penalty=1.8),
    "repetition-below-1": dict(repetition_penalty=0.6),
    "logit-bias": dict(logit_bias={17: 0.3, 40: -100.0, 41: 2.0}),
    "all": dict(
        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={9: 0.2}
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_each_adjustment_matches_the_reference(hf, llm, case):
    prompts = random_prompts(4, 3, 50, seed=3)
    params = SamplingParams(max_tokens=20, **GREEDY, **CASES[case])
    outs = llm.generate(prompts, params)
    want = [reference_greedy(hf, p, params, 20) for p in prompts]
    assert [o.token_ids for o in outs] == want
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    assert [o.token_ids for o in plain] != want  # the adjustment changed something


@pytest.mark.parametrize("case", ["negative-frequency", "repetition", "all"])
def test_greedy_with_adjustments_is_identical_with_speculation(llama_dir, llm, case):
    """A verification row counts the guesses before it: with a negative frequency penalty
    the model repeats itself, n-gram guesses are kept, and the counts must include them (a
    repetition penalty leaves the n-grams nothing to find after the first step)."""
    prompts = [p + p[:12] for p in random_prompts(6, 10, 40, seed=21)]
    params = SamplingParams(max_tokens=40, **GREEDY, **CASES[case])
    plain = llm.generate(prompts, params)
    spec_llm = LLM(str(llama_dir), dtype="float32", speculative=NGRAM)
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = spec_llm.engine.speculation.stats
    if case == "negative-frequency":
        assert stats.accepted > 10


def test_batched_adjustments_match_the_reference_row_by_row():
    """Rows of verification windows (offsets) and plain rows, each request with its own
    settings, some with none (min_p is the sampler's: it changes no logits here)."""
    g = torch.Generator().manual_seed(0)
    settings = [
        dict(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.5),
        dict(),
        dict(min_p=0.2, temperature=0.7, logit_bias={3: -100.0, 5: 50.0}),
        dict(min_p=0.3, temperature=0.0, frequency_penalty=1.0),  # greedy: min_p is moot
    ]
    reqs, offsets = [], []
    for i, kw in enumerate(settings):
        prompt = torch.randint(0, VOCAB, (12,), generator=g).tolist()
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=None, **kw), max_tokens=64)
        req.token_ids += torch.randint(0, 20, (30,), generator=g).tolist()  # its output
        req.spec.guesses = torch.randint(0, 20, (3,), generator=g).tolist()
        reqs += [req] * 4
        offsets += [0, 1, 2, 3]
    logits = torch.randn(len(reqs), VOCAB, generator=g) * 3
    copy = logits.clone()
    got = apply_penalties(logits, reqs, offsets)
    assert torch.equal(logits, copy)  # a copy changed; in place only when asked
    assert torch.equal(apply_penalties(copy, reqs, offsets, inplace=True), got)
    assert torch.equal(copy, got)
    for row, (r, j) in enumerate(zip(reqs, offsets)):
        prompt = r.token_ids[: r.num_prompt_tokens]
        want = reference(logits[row], prompt, r.output_token_ids + r.spec.guesses[:j], r.params)
        torch.testing.assert_close(got[row], want)
    plain = [Request("p", [1, 2], SamplingParams(), max_tokens=4)] * 2
    same = logits[:2]
    assert apply_penalties(same, plain) is same  # nothing asked: the same tensor, no copy


def test_logit_bias_forces_and_bans_tokens(llm):
    prompts = random_prompts(3, 5, 30, seed=4)
    forced = llm.generate(prompts, SamplingParams(max_tokens=8, logit_bias={77: 100.0}))
    assert all(o.token_ids == [77] * 8 for o in forced)  # sampled at temperature 1 too
    plain = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    banned = {t for o in plain for t in o.token_ids}
    bias = {t: -100.0 for t in banned}
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, logit_bias=bias, **GREEDY))
    assert not banned & {t for o in outs for t in o.token_ids}


def test_min_p_of_one_keeps_only_the_most_likely_token(llm):
    prompts = random_prompts(3, 5, 30, seed=6)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    sampled = llm.generate(
        prompts, SamplingParams(max_tokens=10, min_p=1.0, temperature=1.5, ignore_eos=True)
    )
    assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
    ],
)
def test_bad_values_name_their_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and e.value.status == 400


def test_logit_bias_ids_must_be_in_the_vocabulary(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.make_request(Submission([5, 6], SamplingParams(logit_bias={VOCAB: 1.0})))
    assert e.value.param == "logit_bias"


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].log_softmax(-1)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}], ids=["one", "chunked"])
def test_prompt_logprobs_match_transformers(hf, llama_dir, options):
    llm = LLM(str(llama_dir), dtype="float32", **options)
    prompts = random_prompts(4, 2, 70, seed=8)
    shared = prompts[0] + prompts[1]
    llm.generate(shared + [9], SamplingParams(max_tokens=1))  # leaves its prefix cached
    prompts.append(shared + [11, 12])
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, prompt_logprobs=3, **GREEDY))
    for p, out in zip(prompts, outs):
        assert out.num_cached_tokens == 0  # prompt logprobs need every position computed
        lp = hf_prompt_logprobs(hf, p)
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for k, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry["token"] == pytest.approx(lp[k - 1, p[k]].item(), abs=1e-4)
            ids = [t for t, _ in entry["top"]]
            assert ids == lp[k - 1].topk(3).indices.tolist()
    alone = llm.generate(prompts[-1], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert outs[-1].token_ids == alone.token_ids


def test_prompt_logprobs_survive_preemption(hf, llama_dir):
    """A preempted request computes its prompt again: its entries are not added twice."""
    small = LLM(str(llama_dir), dtype="float32", num_kv_blocks=12, max_num_batched_tokens=24)
    prompts = random_prompts(6, 20, 40, seed=12)
    params = SamplingParams(max_tokens=40, prompt_logprobs=0, **GREEDY)
    outs = small.generate(prompts, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for p, out in zip(prompts, outs):
        lp = hf_prompt_logprobs(hf, p)
        want = [lp[k - 1, p[k]].item() for k in range(1, len(p))]
        assert [e["token"] for e in out.prompt_logprobs[1:]] == pytest.approx(want, abs=1e-4)
        assert all(e["top"] == [] for e in out.prompt_logprobs[1:])
