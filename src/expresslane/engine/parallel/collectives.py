"""The collectives of a tensor-parallel group, on one `torch.distributed` process group made
directly from a store (no global default group: several engines may live in one process).
Gloo on a CPU, NCCL on CUDA; every call waits at most `timeout`.

Every rank is a process on this machine, and gloo's sockets take no authentication: they bind
127.0.0.1 (gloo's default is the address the host name resolves to, which may be a public
interface), unless `GLOO_SOCKET_IFNAME` names an interface to use instead. The rendezvous
store listens on a loopback socket made here: given only a host name, TCPStore listens on
every interface (`::`)."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

# How long a rank waits in one collective for the others: they run the same forward pass, so
# only a rank that hangs or died makes one wait long (a dead rank's gloo peers fail at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)


class CollectiveError(RuntimeError):
    """A collective failed: a rank died, hung, or its connection broke."""


def host_store(size: int) -> dist.TCPStore:
    """The rendezvous store rank 0 hosts on a free loopback port (`.port`)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(size)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        size,
        True,
        timeout=RENDEZVOUS_TIMEOUT,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket now
    )


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, False, timeout=RENDEZVOUS_TIMEOUT)


def use_loopback() -> None:
    """Gloo's sockets on the loopback interface, unless `GLOO_SOCKET_IFNAME` names one (gloo
    reads it when it makes its device)."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # Linux's loopback (the ranks run on Linux)


class Collectives:
    """Rank `rank` of `size` in one process group; blocks until every rank has joined."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device):
        self.rank, self.size = rank, size
        if device.type == "cuda":  # untested here; NCCL's own timeout applies
            self.group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            use_loopback()
            self.group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        # what a failed collective raises, made from the CollectiveError (rank 0's group's)
        self.on_error: Callable[[CollectiveError], Exception] | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place."""
        self._wait(self.group.allreduce([t]))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` side by side on the last axis, on every rank."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [t]))
        return torch.cat(parts, dim=-1)

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """On rank 0 every rank's `t` side by side on the last axis; None on the others."""
        t = t.contiguous()
        parts = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._wait(self.group.gather(parts, [t], options))
        return torch.cat(parts[0], dim=-1) if self.rank == 0 else None

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as e:  # gloo and NCCL raise RuntimeError subclasses
            error = CollectiveError(str(e).split("\n")[0])
            raise (error if self.on_error is None else self.on_error(error)) from e
