"""Sampling controls clients send (presence/frequency/repetition penalties, logit_bias, min_p)
and Completions' echo with logprobs, through the official SDK against the real server."""

from __future__ import annotations

import openai
import pytest

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 300, 17], [100, 200, 300, 400, 12]]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def _tokens(client, model, prompt, n=24, **kwargs) -> list[str]:
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    c = client.completions.create(
        model=model, prompt=prompt, max_tokens=n, logprobs=0, extra_body=extra, **kwargs
    )
    return c.choices[0].logprobs.tokens


def _text(engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _distinct(client, model, **kwargs) -> list[int]:
    return [len(set(_tokens(client, model, p, temperature=0, **kwargs))) for p in PROMPTS]


def test_penalties_change_output_in_their_direction(client, model_name):
    """A positive penalty makes the output repeat itself less (more distinct tokens), a
    negative one more; the random model, left alone, loops on a token."""
    plain = _distinct(client, model_name)
    for kwargs in (
        dict(frequency_penalty=1.0),
        dict(presence_penalty=1.0),
        dict(extra_body={"repetition_penalty": 2.0}),
    ):
        more = _distinct(client, model_name, **kwargs)
        assert all(m >= p for m, p in zip(more, plain)) and more != plain, kwargs
    less = _distinct(client, model_name, frequency_penalty=-1.0, presence_penalty=-1.0)
    assert all(m <= p for m, p in zip(less, plain)) and less != plain


def test_chat_takes_the_penalties(client, model_name):
    def content(extra_body=None, **kwargs) -> list[str]:
        r = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "count"}],
            max_completion_tokens=24,
            logprobs=True,
            temperature=0,
            extra_body={"ignore_eos": True, **(extra_body or {})},
            **kwargs,
        )
        return [t.token for t in r.choices[0].logprobs.content]

    plain = content()
    penalized = content(presence_penalty=2.0, extra_body={"min_p": 0.1})
    assert len(set(penalized)) > len(set(plain))


def test_responses_take_repetition_penalty_and_min_p(client, model_name):
    def text(**extra) -> str:
        r = client.responses.create(
            model=model_name,
            input="count",
            max_output_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
        return r.output_text

    assert text(repetition_penalty=3.0, min_p=0.05) != text()


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(client, model_name, engine):
    token = _text(engine, 300)
    forced = _tokens(client, model_name, "def f(x):", n=8, logit_bias={"300": 100})
    assert forced == [token] * 8  # at temperature 1 too
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logit_bias={"300": 100},
        **GREEDY,
    )
    assert r.choices[0].message.content == engine.tokenizer.decode([300] * 4)
    for prompt in PROMPTS:
        plain = _tokens(client, model_name, prompt, n=8, temperature=0)
        banned = {str(t): -100 for t in range(512) if _text(engine, t) in plain}
        outs = _tokens(client, model_name, prompt, n=8, temperature=0, logit_bias=banned)
        assert not set(outs) & set(plain)


def test_min_p_of_one_samples_the_greedy_token(client, model_name):
    for prompt in PROMPTS:
        greedy = _tokens(client, model_name, prompt, n=12, temperature=0)
        sampled = _tokens(client, model_name, prompt, n=12, temperature=2, extra_body={"min_p": 1})
        assert sampled == greedy


def test_echo_with_logprobs_has_the_prompt_tokens_first(client, model_name):
    kwargs = dict(model=model_name, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0)
    plain = client.completions.create(logprobs=3, **kwargs)
    echo = client.completions.create(echo=True, logprobs=3, **kwargs)
    lp, gen = echo.choices[0].logprobs, plain.choices[0].logprobs
    n_prompt = echo.usage.prompt_tokens
    assert n_prompt == 4 and len(lp.tokens) == n_prompt + len(gen.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(0 < len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.tokens[n_prompt:] == gen.tokens
    assert lp.token_logprobs[n_prompt:] == pytest.approx(gen.token_logprobs, abs=1e-4)
    assert "".join(lp.tokens) == echo.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[n_prompt] == len(echo.choices[0].text) - len(plain.choices[0].text)
    chunks = list(client.completions.create(echo=True, logprobs=3, stream=True, **kwargs))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert "".join(ch.choices[0].text for ch in chunks) == echo.choices[0].text


def test_echo_logprobs_score_each_prompt_token_as_generation_would(client, model_name, engine):
    """The logprob echoed for prompt token k is the one the model gave it after tokens < k."""
    first = client.completions.create(
        model=model_name, prompt=[5, 6, 7], max_tokens=1, temperature=0, logprobs=1
    )
    token = first.choices[0].logprobs.tokens[0]
    token_id = next(t for t in range(512) if _text(engine, t) == token)
    echo = client.completions.create(
        model=model_name, prompt=[5, 6, 7, token_id], max_tokens=1, echo=True, logprobs=1
    )
    assert echo.choices[0].logprobs.tokens[3] == token
    want = first.choices[0].logprobs.token_logprobs[0]
    assert echo.choices[0].logprobs.token_logprobs[3] == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"512": 1}}, "logit_bias"),  # past the vocabulary
    ],
)
def test_bad_values_are_400_naming_the_field(client, model_name, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="x", max_tokens=1, extra_body=body)
    assert e.value.param == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=1,
            extra_body=body,
        )
    assert e.value.param == param


@pytest.mark.parametrize("body", [{"repetition_penalty": -1}, {"min_p": 2}])
def test_responses_reject_bad_values_naming_the_field(client, model_name, body):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_name, input="x", extra_body=body)
    assert e.value.param == next(iter(body))
