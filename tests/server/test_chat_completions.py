"""Chat Completions with the openai SDK: plain, streamed (chunks and the stream helper),
include_usage, logprobs, stop, seed, n, max_tokens / max_completion_tokens."""

from __future__ import annotations

from .conftest import STOP_AT_FIRST

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]


def test_plain(client, model_name):
    c = client.chat.completions.create(model=model_name, messages=MSGS, max_tokens=6, temperature=0)
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion"
    ch = c.choices[0]
    assert ch.index == 0 and ch.message.role == "assistant"
    assert ch.finish_reason in ("stop", "length")
    assert c.usage.prompt_tokens > 0 and 1 <= c.usage.completion_tokens <= 6
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert c.service_tier == "default"


def test_stream_chunks_include_usage_and_equality(client, model_name):
    kwargs = dict(model=model_name, messages=MSGS, max_completion_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert len({ch.id for ch in chunks}) == 1
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == plain.choices[0].finish_reason and not any(finish[:-1])
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()

    no_usage = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(ch.choices for ch in no_usage)


def test_stream_helper(client, model_name):
    kwargs = dict(
        model=model_name, messages=MSGS, max_tokens=6, temperature=0, extra_body=STOP_AT_FIRST
    )
    plain = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.content == plain.choices[0].message.content


async def test_async_stream_helper(aclient, model_name):
    async with aclient.chat.completions.stream(
        model=model_name, messages=MSGS, max_tokens=4, temperature=0, extra_body=STOP_AT_FIRST
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert final.usage is None or final.usage.completion_tokens == 1


def test_logprobs(client, model_name):
    c = client.chat.completions.create(
        model=model_name, messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    lps = c.choices[0].logprobs.content
    assert len(lps) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in lps)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in lps)
    streamed = list(
        client.chat.completions.create(
            model=model_name,
            messages=MSGS,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    got = [
        e
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert [e.token for e in got] == [e.token for e in lps]


def test_seed_n_and_stop(client, model_name):
    kwargs = dict(model=model_name, messages=MSGS, max_tokens=8, temperature=1.0, seed=123)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = client.chat.completions.create(n=3, **kwargs)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.usage.prompt_tokens == a.usage.prompt_tokens
    assert many.usage.completion_tokens >= 3
    text = a.choices[0].message.content
    if len(text) > 4:
        stopped = client.chat.completions.create(stop=[text[2:4]], **kwargs)
        assert stopped.choices[0].message.content == text[: text.index(text[2:4])]
        assert stopped.choices[0].finish_reason == "stop"
