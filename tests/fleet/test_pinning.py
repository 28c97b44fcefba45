"""A pool's `cpu_affinity` pins every thread of its replica's process, not only the caller."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

SCRIPT = textwrap.dedent(
    """
    import os, threading
    from expresslane.fleet.replica import pin_process

    def waiting_thread():
        started = threading.Event()

        def wait():
            started.set()
            threading.Event().wait()

        threading.Thread(target=wait, daemon=True).start()
        started.wait()  # alive until the process ends: listed below, never gone while read

    waiting_thread()
    pin_process([0])
    waiting_thread()  # started after: inherits the pin
    for tid in os.listdir("/proc/self/task"):
        print(tid, sorted(os.sched_getaffinity(int(tid))))
    """
)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores",
)
def test_every_thread_of_the_process_is_pinned():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    affinities = [line.split(" ", 1)[1] for line in out.splitlines()]
    assert len(affinities) >= 3 and set(affinities) == {"[0]"}
