"""Each rank's threads on cores of its own: the process's cores split into one contiguous
run per rank, and as many intra-op threads as cores (ranks that share cores would slow each
other at every collective). `EXPRESSLANE_TP_PIN=0` leaves the threads where the scheduler
puts them: on a machine shared with other busy processes a pinned rank cannot move off a busy
core, and each collective waits for it (an all-reduce took 1.8 ms pinned and 0.5-0.6 ms
unpinned on a loaded 2-core machine)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


def enabled() -> bool:
    return os.environ.get("EXPRESSLANE_TP_PIN", "1") != "0"


def rank_cores(rank: int, size: int, cores: list[int] | None = None) -> list[int]:
    """Rank `rank`'s part of `cores` (default: the cores this process may run on); every
    rank gets them all where there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(cores) < size:
        return cores
    per, extra = divmod(len(cores), size)
    start = rank * per + min(rank, extra)
    return cores[start : start + per + (rank < extra)]


def _threads() -> list[int]:
    return [int(p.name) for p in Path("/proc/self/task").iterdir()]


def take_cores(cores: list[int]) -> tuple[set[int], int]:
    """As many torch threads as `cores`, and every thread of this process on them (unless
    `enabled()` says not: the threads are still counted, as ranks sharing cores beyond them
    would spin against each other); returns what to give `unpin` to undo it."""
    before = os.sched_getaffinity(0), torch.get_num_threads()
    if enabled():
        _set_all(set(cores))
    torch.set_num_threads(len(cores))
    return before


def unpin(before: tuple[set[int], int]) -> None:
    cores, threads = before
    _set_all(cores)
    torch.set_num_threads(threads)


def _set_all(cores: set[int]) -> None:
    for tid in _threads():
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended
            os.sched_setaffinity(tid, cores)
