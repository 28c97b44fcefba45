"""Sampling (engine/sampler.py): the filtered distribution against a definition written out
token by token, and the native CPU kernel (kernels/sample_cpu.cpp) against that distribution:
every token drawn where its interval of the cumulative probability says, none outside it."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from expresslane import SamplingParams
from expresslane.engine.request import Request
from expresslane.engine.sampler import Sampler, filtered_probs
from expresslane.kernels import cpu_kernels

F64 = torch.float64


def settings(rows: list[dict]) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor([r.get("temperature", 1.0) for r in rows], dtype=F64),
        torch.tensor([r.get("top_k", 0) for r in rows], dtype=torch.int64),
        torch.tensor([r.get("top_p", 1.0) for r in rows], dtype=F64),
        torch.tensor([r.get("min_p", 0.0) for r in rows], dtype=F64),
    )


def definition(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """One row's distribution, token by token, in float64."""
    p = (logits.double() / temperature).softmax(-1).tolist()
    top = max(p)
    p = [x if x >= min_p * top else 0.0 for x in p]
    if top_k > 0:
        p = [x if sum(y > x for y in p) < top_k else 0.0 for x in p]
    if top_p < 1.0:
        total = sum(p)
        p = [x if sum(y for y in p if y > x) < top_p * total else 0.0 for x in p]
    out = torch.tensor(p, dtype=F64)
    return out / out.sum()


def tied_logits(vocab: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid (many ties), a few tokens masked to -inf."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(vocab, generator=g) * 4).round() / 2
    x[torch.randperm(vocab, generator=g)[: vocab // 10]] = float("-inf")
    return x


CASES = [
    dict(),
    dict(temperature=0.6),
    dict(temperature=1.7, min_p=0.05),
    dict(top_k=7),
    dict(top_k=40, temperature=0.8),
    dict(top_p=0.5),
    dict(top_p=0.9, temperature=1.3),
    dict(top_k=20, top_p=0.6, min_p=0.01, temperature=0.9),
    dict(top_p=1e-9),  # the most likely tokens only
    dict(min_p=1.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_filtered_probs_follow_the_definition(case):
    rows = torch.stack([tied_logits(120, seed) for seed in range(4)])
    got = filtered_probs(rows, *settings([case] * 4))
    for row, logits in zip(got, rows, strict=True):
        torch.testing.assert_close(row.double(), definition(logits, **case), atol=2e-6, rtol=1e-4)


def native():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels in this build")
    return kernels


def midpoints(probs: torch.Tensor, least: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, u): the tokens of probability >= least and the middle of each one's interval."""
    cdf = probs.cumsum(-1)
    tokens = (probs >= least).nonzero().view(-1)
    u = (cdf[tokens] - probs[tokens] / 2).clamp(max=1 - 1e-12)
    return tokens, u


def native_draws(kernels, path: str, logits: torch.Tensor, case: dict, u: torch.Tensor):
    """Tokens drawn at each u from one row, in one call (`fused`) or from the filtered
    weights (`filter+draw`)."""
    n, vocab = len(u), logits.shape[-1]
    if path == "fused":
        return kernels.sample_rows(logits.expand(n, vocab).contiguous(), *settings([case] * n), u)
    weights = kernels.filter_rows(logits[None], *settings([case]))
    want = filtered_probs(logits[None], *settings([case]))
    torch.testing.assert_close(weights / weights.sum(-1, keepdim=True), want, atol=1e-6, rtol=1e-4)
    return kernels.draw_rows(weights.expand(n, vocab).contiguous(), u)


@pytest.mark.parametrize("path", ["fused", "filter+draw"])
@pytest.mark.parametrize("vocab", [37, 5000, 49152])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_native_draws_follow_the_distribution(vocab, case, path):
    """Each token of probability >= 1e-4 is drawn at the middle of its interval; 1,000 draws
    at random u land only on tokens the distribution has."""
    kernels = native()
    for seed in range(2):
        logits = tied_logits(vocab, seed) if seed == 0 else torch.randn(vocab) * 3
        want = filtered_probs(logits[None], *settings([case]))[0].double()
        want /= want.sum()
        tokens, u = midpoints(want, 1e-4)
        u = torch.cat([u, torch.rand(1000, dtype=F64)])
        got = native_draws(kernels, path, logits, case, u)
        assert got[: len(tokens)].tolist() == tokens.tolist()
        assert bool((want[got] > 0).all())


def test_native_draws_pass_a_chi_square_test():
    kernels = native()
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    case = dict(temperature=0.8, top_p=0.95)
    want = filtered_probs(logits[None], *settings([case]))[0].double()
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=F64)
    got = kernels.sample_rows(logits.expand(n, 50).contiguous(), *settings([case] * n), u)
    counts = torch.bincount(got, minlength=50).double()
    support = want > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], want[support] / want[support].sum() * n).pvalue > 1e-4


def test_native_rows_without_a_finite_maximum_take_the_argmax():
    kernels = native()
    rows = torch.full((3, 16), float("-inf"))
    rows[1, 5] = float("nan")
    rows[2, 9] = float("inf")
    rows[2, 11] = 1.0
    u = torch.tensor([0.5, 0.5, 0.5], dtype=F64)
    got = kernels.sample_rows(rows, *settings([{}] * 3), u)
    assert got.tolist() == rows.argmax(-1).tolist()
    weights = kernels.filter_rows(rows, *settings([{}] * 3))
    assert torch.equal(weights, torch.nn.functional.one_hot(got, 16).float())
    assert kernels.draw_rows(torch.zeros(1, 8), u[:1]).tolist() == [0]  # no weight: the first


def test_native_refuses_settings_out_of_range():
    kernels = native()
    logits = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="temperature > 0"):
        kernels.sample_rows(logits, *settings([dict(temperature=0.0)]), torch.zeros(1, dtype=F64))


def test_a_batch_samples_each_row_by_its_own_settings_and_seed():
    """Greedy rows take the argmax; a seeded row draws the same token whatever its batch."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=g) * 2
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, top_p=0.8, seed=11),
        SamplingParams(temperature=1.2, top_k=5, seed=12),
        SamplingParams(temperature=0.7, min_p=0.2, seed=13),
    ]

    def sample(rows: list[int]) -> list[int]:
        reqs = [Request(f"r{i}", [1], params[i], max_tokens=4) for i in rows]
        return Sampler(torch.device("cpu"), seed=0)(logits[rows], reqs).token_ids

    together = sample([0, 1, 2, 3])
    assert together[0] == int(logits[0].argmax())
    assert [sample([i])[0] for i in range(4)] == together
    # the engine's plain rows come with offsets (no guesses to score): the same draws
    reqs = [Request(f"r{i}", [1], params[i], max_tokens=4) for i in range(4)]
    assert Sampler(torch.device("cpu"))(logits, reqs, [0] * 4).token_ids == together
    for i in (1, 2, 3):
        p = params[i]
        want = filtered_probs(logits[i : i + 1], *settings([vars(p)]))[0]
        assert want[together[i]] > 0
