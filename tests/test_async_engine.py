"""AsyncEngine: streams, abort, and bad input next to good requests."""

from __future__ import annotations

import asyncio

import pytest

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.errors import InvalidRequestError

from .conftest import random_prompts


@pytest.fixture
def aengine(llama_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32")))
    yield engine
    engine.shutdown()


async def collect(stream):
    ids, text, last = [], "", None
    async for out in stream:
        ids += out.new_token_ids
        text += out.new_text
        last = out
    return ids, text, last


async def test_stream_matches_offline_generate(aengine, llama_dir):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids, text, last = await collect(aengine.submit("def main(", params))
    ref = LLM(str(llama_dir), dtype="float32").generate("def main(", params)[0]
    assert ids == ref.token_ids and text == ref.text
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 20
    assert last.metrics.ttft is not None and last.metrics.ttft <= last.metrics.e2e


async def test_abort_frees_blocks_and_ends_the_stream(aengine):
    stream = aengine.submit(
        [5] * 40, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    )
    seen, aborted = 0, False
    async for out in stream:
        seen += len(out.new_token_ids)
        if seen >= 3 and not aborted:  # a consumer that lags gets several tokens at once
            aengine.abort(stream.request_id)
            aborted = True
        if out.finished:
            assert out.finish_reason == "abort"
    assert 3 <= seen < 400
    await asyncio.sleep(0.05)
    assert aengine.engine.kv.num_used_blocks == 0


async def test_consumer_leaving_early_aborts(aengine):
    stream = aengine.submit(
        [7] * 30, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    )
    async for _ in stream:
        break
    for _ in range(100):
        await asyncio.sleep(0.01)
        if not aengine.engine.has_unfinished():
            break
    assert aengine.engine.kv.num_used_blocks == 0 and not aengine.engine.requests


async def test_bad_requests_fail_fast_and_leave_others_alone(aengine):
    good = [
        aengine.submit(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        for p in random_prompts(4, 5, 30)
    ]
    n = aengine.engine.max_model_len
    for bad in ([1] * (n + 1), [], [-1, 2]):
        with pytest.raises(InvalidRequestError):
            aengine.submit(bad, SamplingParams(max_tokens=4))
    results = await asyncio.gather(*(collect(s) for s in good))
    assert all(len(ids) == 16 and last.finish_reason == "length" for ids, _, last in results)


async def test_an_output_buffer_merges_what_waited_and_stops_at_the_last():
    from expresslane.engine.output import RequestOutput
    from expresslane.engine.output_buffer import OutputBuffer
    from expresslane.engine.request import RequestMetrics

    def output(ids: list[int], finished: bool = False) -> RequestOutput:
        text = "".join(f"<{i}>" for i in ids)
        return RequestOutput("r", ids, text, finished, None, 3, 0, 0, RequestMetrics(0.0))

    buffer = OutputBuffer()
    reader = asyncio.ensure_future(buffer.take())
    await asyncio.sleep(0)
    assert not reader.done()  # it waits for an output
    buffer.put(output([1]))
    assert (await reader).new_token_ids == [1]
    buffer.put(output([2]))
    buffer.put(output([3], finished=True))
    buffer.put(output([4]))  # after the finished output: dropped
    last = await buffer.take()
    assert (last.new_token_ids, last.new_text, last.finished) == ([2, 3], "<2><3>", True)
    assert buffer.ended
