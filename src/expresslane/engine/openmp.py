"""One OpenMP thread team per process: the step loop's.

PyTorch's CPU ops and the C++ kernels run their parallel loops on OpenMP. libgomp keeps a team
of worker threads for each thread that ever ran a parallel region, and once the threads it
manages outnumber the CPUs it stops spinning between regions: each region then starts with a
futex wake-up of every worker. A server loads the model on one thread and steps it on another
(`AsyncEngine`), so two teams exist; on 2 cores that halved the served decode speed of a
135M model (55 against 138 tokens/s offline). The loading thread gives its team back before
the step loop starts (`release_team`), which leaves the step loop's team the only one.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger("expresslane.engine")

# The OpenMP runtimes PyTorch builds link (GNU, LLVM, Intel), by file name.
RUNTIMES = ("libgomp", "libomp", "libiomp5")
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep nothing else
PR_SET_NAME = 15  # prctl(2)


def loaded_runtimes(maps: str | None = None) -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; elsewhere none)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    paths = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        path = fields[5] if len(fields) == 6 else ""
        if Path(path).name.startswith(RUNTIMES) and path not in paths:
            paths.append(path)
    return paths


def _pause_functions() -> list:
    functions = []
    for path in loaded_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        functions.append(pause)
    return functions


def release_team() -> bool:
    """Let the calling thread's OpenMP worker threads exit (they come back if it runs a
    parallel region again). False where no runtime could do it."""
    released = False
    for pause in _pause_functions():
        released |= pause(OMP_PAUSE_SOFT) == 0
    if not released:
        log.debug("no OpenMP runtime released its threads")
    return released


def name_thread(name: str) -> None:
    """Give the calling thread an OS name (Linux; at most 15 bytes). The OpenMP workers it
    starts inherit it, so `top -H`, py-spy and the tests tell the step loop's team apart."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass
