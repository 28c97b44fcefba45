"""The fleet's token channel on real TCP on 127.0.0.1, fed by a real engine on the demo model:
one frame per engine step for all of an ingress's requests, the same tokens as a request's own
stream, the secret checked before anything is unpickled, and a lost connection heard of."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.engine.submission import Submission
from expresslane.fleet.token_channel import TokenInbox, TokenOutbox, frame
from expresslane.sampling_params import SamplingParams

PROMPTS = ["def add(a, b):", "Hello, how are", "import os\nimport", "The capital of France"]
TOKENS = 12


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(LLMEngine(EngineConfig(calibrate=False, num_kv_blocks=256, seed=0)))
    yield eng
    eng.shutdown()


class Collector:
    """A receiver: what each reply key got, and whether its replica's link was lost."""

    def __init__(self):
        self.outputs: list = []
        self.lost = asyncio.Event()
        self.finished = asyncio.Event()

    def receive(self, out, replica: str) -> None:
        self.outputs.append((out, replica))
        if out.finished:
            self.finished.set()

    def link_lost(self, replica: str) -> None:
        self.lost.set()


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


async def _own_streams(engine) -> list[list[int]]:
    async def one(prompt):
        return [t async for out in engine.submit(prompt, _params()) for t in out.new_token_ids]

    return await asyncio.gather(*(one(p) for p in PROMPTS))


class CountingOutbox(TokenOutbox):
    def deliver(self, outputs):
        self.deliveries.append(len(outputs))
        super().deliver(outputs)


async def _through_the_channel(engine, interval: int = 1):
    inbox = TokenInbox("127.0.0.1")
    await inbox.start()
    outbox = await CountingOutbox.open(inbox.address, "replica-a", interval, lambda o: None)
    outbox.deliveries = []
    collectors, done = [], []
    for i, prompt in enumerate(PROMPTS):
        req = engine.make_request(Submission(prompt, _params(), f"req-{i}"))
        collectors.append(Collector())
        inbox.expect(f"key-{i}", collectors[-1])
        done.append(outbox.add(req.request_id, f"key-{i}"))
        engine.enqueue_to(req, outbox)
    await asyncio.gather(*done)
    await asyncio.gather(*(c.finished.wait() for c in collectors))
    outbox.close()
    await inbox.close()
    return collectors, outbox.deliveries


def test_a_step_is_one_delivery_and_the_tokens_match_own_streams(engine):
    async def run():
        return await _own_streams(engine), await _through_the_channel(engine)

    own, (collectors, deliveries) = asyncio.run(run())
    got = [[t for out, _ in c.outputs for t in out.new_token_ids] for c in collectors]
    assert got == own
    assert all(replica == "replica-a" for c in collectors for _, replica in c.outputs)
    assert all(c.outputs[-1][0].finished and c.outputs[-1][0].num_output_tokens == TOKENS
               for c in collectors)  # fmt: skip
    # the four requests ran in one batch: most steps carried outputs of several of them
    assert sum(deliveries) == sum(len(c.outputs) for c in collectors)
    assert len(deliveries) < sum(deliveries) / 2


def test_tokens_are_gathered_to_the_stream_interval(engine):
    collectors, _ = asyncio.run(_through_the_channel(engine, interval=5))
    for c in collectors:
        sizes = [len(out.new_token_ids) for out, _ in c.outputs]
        assert sizes[0] == 1 and sum(sizes) == TOKENS  # the first token at once
        assert all(s >= 5 for s in sizes[1:-1])


def test_a_connection_without_the_secret_delivers_nothing():
    async def run():
        inbox = TokenInbox("127.0.0.1")
        await inbox.start()
        collector = Collector()
        inbox.expect("key-0", collector)
        reader, writer = await asyncio.open_connection("127.0.0.1", inbox.port)
        writer.write(frame(b"not-the-secret\n" + b'{"replica": "x"}'))
        writer.write(frame(pickle.dumps([("key-0", "anything")])))
        await writer.drain()
        closed = await reader.read()  # the inbox hangs up without reading on
        writer.close()
        await inbox.close()
        return closed, collector

    closed, collector = asyncio.run(run())
    assert closed == b"" and collector.outputs == [] and not collector.lost.is_set()


def test_a_lost_connection_fails_both_ends(engine):
    async def run():
        inbox = TokenInbox("127.0.0.1")
        await inbox.start()
        outbox = await TokenOutbox.open(inbox.address, "replica-a", 1, lambda o: None)
        collector = Collector()
        inbox.expect("key-0", collector)
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        req = engine.make_request(Submission(PROMPTS[0], params, "long"))
        done = outbox.add(req.request_id, "key-0")
        engine.enqueue_to(req, outbox)
        while not collector.outputs:  # it has started answering
            await asyncio.sleep(0.01)
        outbox.close()  # the replica's end goes away
        await collector.lost.wait()
        with pytest.raises(ConnectionError):
            await done
        engine.abort(req.request_id)
        await inbox.close()

    asyncio.run(run())
