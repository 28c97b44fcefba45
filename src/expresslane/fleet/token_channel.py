"""The fleet's token path: per engine step, one message from a replica to each ingress.

An ingress replica listens on a TCP port of its node (`TokenInbox`) and names it, with a secret,
in every request it sends a pool (`TokenInbox.address`). The replica that takes the request
connects once per ingress (`TokenOutbox`), says the secret and who it is, and from then on
writes one frame per engine step carrying every new output of that ingress's requests; the
inbox hands each output to its request's stream (`FleetStream.receive`). So the transport's
cost grows with engine steps, not with tokens times requests (one Ray item per token per
request cost 1.6 ms of CPU per token: BENCHMARKS.md, "The fleet").

Requests themselves still go through Ray Serve (its router picks the replica, and the call
stays open until the request finishes, so Serve's drain, autoscaling and load counts see it);
cancelling that call aborts the request in the engine. Frames are a 4-byte length and a pickle
of `[(reply_key, RequestOutput), ...]`; nothing is unpickled from a connection before it showed
the inbox's secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import pickle
import secrets
import struct
from collections.abc import Callable
from typing import Protocol

from expresslane.engine.output import RequestOutput, merge_outputs

log = logging.getLogger("expresslane.fleet")
HEADER = struct.Struct(">I")
SECRET_BYTES = 16
MAX_HELLO = 4096
MAX_UNSENT = 64 << 20  # bytes an ingress may leave unread before its connection is dropped


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if limit is not None and size > limit:
        raise ConnectionError(f"a {size}-byte frame where at most {limit} were expected")
    return await reader.readexactly(size)


# -- the ingress's side -------------------------------------------------------------------------


class Receiver(Protocol):
    """What an inbox hands outputs to (remote_engine.FleetStream)."""

    def receive(self, out: RequestOutput, replica: str) -> None: ...

    def link_lost(self, replica: str) -> None: ...


class TokenInbox:
    """The port replicas send this ingress's tokens to; one connection per replica."""

    def __init__(self, host: str):
        self.host = host
        self.secret = secrets.token_hex(SECRET_BYTES)
        self._receivers: dict[str, Receiver] = {}
        self._senders: dict[str, str] = {}  # reply key -> the replica that sends to it
        self._server: asyncio.Server | None = None
        self._open: dict[asyncio.StreamWriter, asyncio.Task] = {}  # connections being served
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> dict:
        return {"host": self.host, "port": self.port, "secret": self.secret}

    def expect(self, key: str, receiver: Receiver) -> None:
        self._receivers[key] = receiver

    def forget(self, key: str) -> None:
        self._receivers.pop(key, None)
        self._senders.pop(key, None)

    async def close(self) -> None:
        """Stop listening and hang up on every replica (their connections end normally)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            writer.close()
        await asyncio.gather(*self._open.values(), return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        replica = None
        self._open[writer] = asyncio.current_task()
        try:
            hello = await read_frame(reader, MAX_HELLO)
            secret, _, who = hello.partition(b"\n")
            if not hmac.compare_digest(secret, self.secret.encode()):
                return  # not one of ours: nothing it sent is unpickled
            replica = json.loads(who)["replica"]
            while True:
                for key, out in pickle.loads(await read_frame(reader)):
                    receiver = self._receivers.get(key)
                    if receiver is not None:  # else a request given up on (cancelled, retried)
                        self._senders[key] = replica
                        receiver.receive(out, replica)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the replica went away; its streams hear of it below
        finally:
            writer.close()
            self._open.pop(writer, None)
            if replica is not None:
                self._lost(replica)

    def _lost(self, replica: str) -> None:
        for key in [k for k, sender in self._senders.items() if sender == replica]:
            self._receivers[key].link_lost(replica)


# -- the replica's side -------------------------------------------------------------------------


class TokenOutbox:
    """One replica's connection to one ingress's inbox. `deliver` runs on the replica's event
    loop once per engine step with that step's outputs of this ingress's requests (the engine
    groups them: AsyncEngine.enqueue_to); it writes them as one frame. A request's tokens are
    held until `stream_interval` of them gathered (its first output and its last go at once)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stream_interval: int,
        on_close: Callable,
    ):
        self._writer = writer
        self._interval = stream_interval
        self._on_close = on_close
        self._keys: dict[str, str] = {}  # request id -> the ingress's reply key
        self._held: dict[str, list[RequestOutput]] = {}
        self._sent_first: set[str] = set()
        self._done: dict[str, asyncio.Future] = {}
        self.closed = False
        self._watch = asyncio.ensure_future(self._watch_close(reader))

    @classmethod
    async def open(cls, address: dict, replica: str, stream_interval: int, on_close: Callable):
        reader, writer = await asyncio.open_connection(address["host"], address["port"])
        hello = address["secret"].encode() + b"\n" + json.dumps({"replica": replica}).encode()
        writer.write(frame(hello))
        return cls(reader, writer, stream_interval, on_close)

    def add(self, request_id: str, key: str) -> asyncio.Future:
        """Send `request_id`'s outputs under `key`; the future resolves once its last output
        was written (or fails if the connection is lost first)."""
        if self.closed:
            raise ConnectionError("the ingress's connection is closed")
        self._keys[request_id] = key
        done = self._done[request_id] = asyncio.get_running_loop().create_future()
        return done

    def deliver(self, outputs: list[RequestOutput]) -> None:
        batch, finished = [], []
        for out in outputs:
            rid = out.request_id
            key = self._keys.get(rid)
            if key is None:
                continue
            held = self._held.setdefault(rid, [])
            held.append(out)
            tokens = sum(len(o.new_token_ids) for o in held)
            if out.finished or rid not in self._sent_first or tokens >= self._interval:
                batch.append((key, merge_outputs(held)))
                del self._held[rid]
                self._sent_first.add(rid)
            if out.finished:
                finished.append(rid)
        if batch and not self.closed:
            self._writer.write(frame(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)))
            if self._writer.transport.get_write_buffer_size() > MAX_UNSENT:
                self.close()  # the ingress stopped reading
        for rid in finished:
            self._keys.pop(rid)
            self._sent_first.discard(rid)
            done = self._done.pop(rid)
            if not done.done():
                done.set_result(None)

    async def flush(self) -> None:
        """Until the kernel took what was written (for a sender that could outpace its reader)."""
        await self._writer.drain()

    def drop(self, request_id: str) -> None:
        """Forget a request whose call ended early (cancelled): nothing more goes for it."""
        self._keys.pop(request_id, None)
        self._held.pop(request_id, None)
        self._sent_first.discard(request_id)
        self._done.pop(request_id, None)

    async def _watch_close(self, reader: asyncio.StreamReader) -> None:
        """The inbox never writes: end of file or an error means the connection is gone."""
        with contextlib.suppress(Exception):
            await reader.read()
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        if self._watch is not asyncio.current_task():
            self._watch.cancel()
        for done in self._done.values():
            if not done.done():
                done.set_exception(ConnectionError("the connection to the ingress closed"))
        self._on_close(self)
