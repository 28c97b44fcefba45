"""Rank 0's side of a tensor-parallel group: it starts the worker ranks, sends each of them
every forward pass its own model runs, watches them, and stops them.

A rank that dies or fails breaks the group for good (its collectives cannot be resumed in
step): the forward pass raises `TensorParallelError`, every later one too, at once, so the
engine fails the step's requests and the next ones instead of hanging."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time

from expresslane.config import EngineConfig
from expresslane.engine.parallel import affinity
from expresslane.engine.parallel.collectives import (
    RENDEZVOUS_TIMEOUT,
    CollectiveError,
    Collectives,
    host_store,
)
from expresslane.engine.parallel.layers import parallelize
from expresslane.engine.parallel.messages import Bind, Failed, Forward, Ready, Stop
from expresslane.engine.parallel.worker import WorkerSpec, run
from expresslane.errors import ExpresslaneError, InvalidRequestError
from expresslane.models.llama import LlamaModel
from expresslane.models.shard import Shard

log = logging.getLogger("expresslane.engine")
STOP_SECONDS = 10  # a worker told to stop that has not exited by then is killed


class TensorParallelError(ExpresslaneError):
    """The tensor-parallel group is broken: a rank died or failed."""


def _check(config: EngineConfig) -> None:
    for option in ("cuda_graphs", "batch_invariant"):
        if getattr(config, option):
            raise InvalidRequestError(f"{option} is not available with tensor parallelism yet")


class TensorParallelGroup:
    def __init__(self, config: EngineConfig, max_len: int):
        """Start ranks 1..size-1 (they load their shards meanwhile) and join them."""
        _check(config)
        size = config.tensor_parallel_size
        self.shard = Shard(0, size)
        self.error: str | None = None  # why the group broke
        self._in_step = False
        self._workers: list = []  # (process, pipe) of ranks 1..size-1
        self._pinned = None  # what to undo at close
        try:
            store = host_store(size)
            self._spawn(config, max_len, store.port)
            self._pinned = affinity.take_cores(affinity.rank_cores(0, size))
            for rank in range(1, size):
                self._expect(rank, str)
            self.comm = Collectives(store, 0, size, config.torch_device())
        except BaseException:
            self.close()
            raise
        self.comm.on_error = self._collective_failed
        self._store: object | None = store

    def _spawn(self, config: EngineConfig, max_len: int, port: int) -> None:
        context = multiprocessing.get_context("spawn")
        size = self.size
        for rank in range(1, size):
            cores = affinity.rank_cores(rank, size)
            spec = WorkerSpec(config, rank, size, port, max_len, cores)
            ours, theirs = context.Pipe()
            proc = context.Process(target=run, args=(spec, theirs), daemon=True, name=f"tp{rank}")
            proc.start()
            theirs.close()
            self._workers.append((proc, ours))

    def bind(self, model: LlamaModel, cache, vocab_size: int) -> None:
        """Once rank 0's runner has bound `model` to its KV cache: the workers allocate
        theirs (the runner's `CacheConfig`), and every forward pass of `model` is sent."""
        for _, conn in self._workers:
            conn.send(Bind(cache))
        for rank in range(1, self.size):
            plan = self._expect(rank, Ready).plan
            log.info("tensor-parallel rank %d: %s", rank, plan)
        parallelize(model, self.comm, self.shard, vocab_size, self._send)
        model.register_forward_hook(self._done)

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def processes(self) -> list:
        """The worker ranks' processes (rank 1 first); none once stopped."""
        return [proc for proc, _ in self._workers]

    def _send(self, args, kwargs) -> None:
        """Before rank 0's forward pass: hand it to every worker."""
        if self.error is None and self._in_step:  # the last forward pass raised midway
            self._fail("a forward pass stopped midway; the ranks are out of step")
        if self.error is None:
            self._check_alive()
        if self.error is not None:
            raise TensorParallelError(self.error)
        msg = Forward.of(*args, *kwargs.values())
        try:
            for _, conn in self._workers:
                conn.send(msg)
        except OSError as e:
            self._fail(f"sending a step failed ({e})")
            raise TensorParallelError(self.error) from e
        self._in_step = True

    def _done(self, module, args, out) -> None:
        self._in_step = False

    def _collective_failed(self, error: CollectiveError) -> TensorParallelError:
        self._fail(f"a collective failed ({error})")
        return TensorParallelError(self.error)

    def _check_alive(self) -> None:
        if not all(proc.is_alive() for proc, _ in self._workers):
            self._fail("found before a step")

    def _death(self, rank: int) -> str:
        proc, conn = self._workers[rank - 1]
        said = ""
        try:
            if conn.poll():
                msg = conn.recv()
                said = f": {msg.error}" if isinstance(msg, Failed) else ""
        except (EOFError, OSError):
            pass
        code = proc.exitcode
        return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}{said}"

    def _fail(self, what: str) -> None:
        """Break the group for good: log why once (a rank that exited first), stop every
        worker."""
        for rank, (proc, _) in enumerate(self._workers, 1):
            proc.join(0.5 if self._in_step else 0)
            if not proc.is_alive() and proc.exitcode not in (None, 0):
                what = f"{self._death(rank)}; {what}"
                break
        self.error = f"tensor parallelism broke, the engine cannot run: {what}"
        self._in_step = False
        log.error("%s; restart the engine", self.error)
        self._stop_workers(kill=True)

    def _expect(self, rank: int, kind: type):
        """The next message of worker `rank`, which must be a `kind` (it loads meanwhile)."""
        proc, conn = self._workers[rank - 1]
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise TensorParallelError(f"{self._death(rank)} while starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {rank} did not start in time")
        msg = conn.recv()
        if not isinstance(msg, kind):
            detail = msg.error if isinstance(msg, Failed) else repr(msg)
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {detail}")
        return msg

    def close(self) -> None:
        """Stop the workers (idempotent), free the rendezvous port, give rank 0 its cores
        back."""
        self._stop_workers(kill=False)
        self._store = None
        if self._pinned is not None:
            affinity.unpin(self._pinned)
            self._pinned = None

    def _stop_workers(self, kill: bool) -> None:
        for proc, conn in self._workers:
            if proc.is_alive() and not kill:
                with contextlib.suppress(OSError):
                    conn.send(Stop())
        for proc, conn in self._workers:
            proc.join(0 if kill else STOP_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self._workers = []
