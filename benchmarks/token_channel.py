"""Which channel carries a replica's per-step outputs to the ingress most cheaply?

One engine step's message is `--batch` requests' outputs of one token each (real
`RequestOutput`s, as a replica sends them). `--steps` such messages go from one process to
another by each channel, one after another; reported: CPU of every process involved (sender,
receiver, and for Ray the raylet, GCS and its other workers, from /proc) per message and per
token, and wall time per message.

  ray-stream   a Ray actor's streaming generator yields the messages (what a replica's
               `generate` stream was, batched per step)
  ray-call     the sender calls an actor method on the receiver per message
  socket       the fleet's token channel: `TokenOutbox` writes a frame per message to a
               `TokenInbox` (fleet/token_channel.py)

    python benchmarks/token_channel.py [--steps 2000] [--batch 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from common import machine, process_cpu_seconds, save_results

from expresslane.engine.output import RequestOutput
from expresslane.engine.request import RequestMetrics


def step_message(batch: int) -> list[RequestOutput]:
    return [
        RequestOutput(f"req-{i}", [1234], " tok", False, None, 40, 0, 7, RequestMetrics(0.0))
        for i in range(batch)
    ]


def cpu_seconds(pids: set[int]) -> float:
    """CPU seconds so far of `pids` and every Ray process."""
    return sum(
        seconds
        for pid, (cmd, seconds) in process_cpu_seconds().items()
        if pid in pids or "ray" in cmd
    )


def rates(cpu_s: float, wall_s: float, steps: int, batch: int) -> dict:
    return {
        "cpu_us_per_message": 1e6 * cpu_s / steps,
        "cpu_us_per_token": 1e6 * cpu_s / (steps * batch),
        "wall_us_per_message": 1e6 * wall_s / steps,
    }


def measure(run, pids: set[int], steps: int, batch: int) -> dict:
    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    run()
    return rates(cpu_seconds(pids) - cpu0, time.perf_counter() - t0, steps, batch)


def ray_channels(steps: int, batch: int) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Peer:
        def pid(self) -> int:
            return os.getpid()

        async def stream(self, n: int, message):
            for _ in range(n):
                yield message

        def take(self, message) -> int:
            return len(message)

    peer = Peer.remote()
    pids = {os.getpid(), ray.get(peer.pid.remote())}
    message = step_message(batch)

    async def by_stream():
        async for ref in peer.stream.options(num_returns="streaming").remote(steps, message):
            assert len(await ref) == batch

    async def by_call():
        for _ in range(steps):
            assert await peer.take.remote(message) == batch

    try:
        return {
            "ray-stream": measure(lambda: asyncio.run(by_stream()), pids, steps, batch),
            "ray-call": measure(lambda: asyncio.run(by_call()), pids, steps, batch),
        }
    finally:
        ray.shutdown()


SENDER = """
import asyncio, sys
sys.path.insert(0, {here!r})
from token_channel import step_message
from expresslane.fleet.token_channel import TokenOutbox

async def main():
    address = {{"host": "127.0.0.1", "port": {port}, "secret": {secret!r}}}
    outbox = await TokenOutbox.open(address, "sender", 1, lambda o: None)
    message = step_message({batch})
    for out in message:
        outbox.add(out.request_id, out.request_id)
    await asyncio.sleep(float(sys.stdin.readline()))  # the parent's start signal
    for _ in range({steps}):
        outbox.deliver(message)
        await outbox.flush()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def socket_channel(steps: int, batch: int) -> dict:
    from expresslane.fleet.token_channel import TokenInbox

    class Count:
        n = 0

        def receive(self, out, replica):
            Count.n += 1

        def link_lost(self, replica):
            pass

    async def run() -> dict:
        inbox = TokenInbox("127.0.0.1")
        await inbox.start()
        for i in range(batch):
            inbox.expect(f"req-{i}", Count())
        code = SENDER.format(
            here=str(Path(__file__).resolve().parent),
            port=inbox.port,
            secret=inbox.secret,
            batch=batch,
            steps=steps,
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
        await asyncio.sleep(3.0)  # connected and idle
        pids = {os.getpid(), child.pid}
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        child.stdin.write("0\n")
        child.stdin.flush()
        while Count.n < steps * batch:
            await asyncio.sleep(0.001)
        cpu1, t1 = cpu_seconds(pids), time.perf_counter()
        child.kill()
        await inbox.close()
        return rates(cpu1 - cpu0, t1 - t0, steps, batch)

    return {"socket": asyncio.run(run())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    results = {"machine": machine(), "settings": vars(args)}
    results.update(ray_channels(args.steps, args.batch))
    results.update(socket_channel(args.steps, args.batch))
    for name in ("ray-stream", "ray-call", "socket"):
        r = results[name]
        print(
            f"{name:10s} CPU {r['cpu_us_per_message']:7.1f} µs per message, "
            f"{r['cpu_us_per_token']:6.2f} µs per token; wall {r['wall_us_per_message']:7.1f} µs"
        )
    print(f"results: {save_results('token_channel', results)}")


if __name__ == "__main__":
    main()
