"""A worker rank: a process that loads its shard of the model and of the KV cache, then runs
every forward pass rank 0 sends it, until told to stop or rank 0 goes away (its pipe closes:
no worker outlives the engine)."""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

import torch

from expresslane.config import EngineConfig
from expresslane.engine.dtypes import model_dtypes
from expresslane.engine.parallel import affinity
from expresslane.engine.parallel.collectives import Collectives, join_store
from expresslane.engine.parallel.layers import parallelize
from expresslane.engine.parallel.messages import Bind, Failed, Forward, Ready, Stop
from expresslane.engine.runner import ModelRunner
from expresslane.models import load_model
from expresslane.models.config import ModelConfig
from expresslane.models.shard import Shard

log = logging.getLogger("expresslane.engine")
STARTED = "started"  # a worker's first message: it is about to join the process group


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    rank: int
    size: int
    port: int  # of rank 0's rendezvous store
    max_len: int  # the model's positions, as rank 0 loads it
    cores: list[int]


def run(spec: WorkerSpec, conn) -> None:
    """The worker process's main: `conn` is its end of the pipe to rank 0."""
    logging.basicConfig(format=f"tp rank {spec.rank}: %(levelname)s %(message)s")
    affinity.take_cores(spec.cores)
    try:
        conn.send(STARTED)
        model = _load(spec)
        _serve(model, conn)
        os._exit(0)  # told to stop: no interpreter teardown (extension modules' leak reports)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # rank 0 went away: nothing to report to
    except Exception as e:
        log.error("tensor-parallel worker failed: %s", traceback.format_exc())
        try:
            conn.send(Failed(f"{type(e).__name__}: {e}"))
        finally:
            os._exit(1)


def _load(spec: WorkerSpec):
    """Join the group, load this rank's shard (while rank 0 loads its own)."""
    config = spec.config
    device = rank_device(config.torch_device(), spec.rank)
    comm = Collectives(join_store(spec.port, spec.size), spec.rank, spec.size, device)
    mcfg = ModelConfig.from_dir(config.model_dir)
    dtype, linear_dtype = model_dtypes(config, mcfg.torch_dtype, device)
    shard = Shard(spec.rank, spec.size)
    model, _ = load_model(
        config.model_dir, dtype, device, spec.max_len, linear_dtype, config.quantization, shard
    )
    parallelize(model, comm, shard, mcfg.vocab_size, None)
    return model


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CUDA device `rank` places past rank 0's (untested: no
    machine here has two GPUs); on a CPU every rank's."""
    if device.type != "cuda":
        return device
    device = torch.device("cuda", (device.index or 0) + rank)
    torch.cuda.set_device(device)
    return device


@torch.inference_mode()
def _serve(model, conn) -> None:
    device = model.device
    while True:
        msg = conn.recv()
        if isinstance(msg, Forward):
            model(*msg.arguments(device))
        elif isinstance(msg, Bind):
            ModelRunner(model, msg.cache)  # allocates this rank's KV stores and binds them
            conn.send(Ready(model.plan.describe()))
        elif isinstance(msg, Stop):
            return
