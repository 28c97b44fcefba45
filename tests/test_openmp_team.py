"""One OpenMP team per serving process: the step loop's (engine/openmp.py).

Each check runs in a fresh interpreter, whose threads are all its own. libgomp's workers take
the OS name of the thread that started them, so naming the main thread tells its team apart
from the step loop's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from expresslane.engine.openmp import loaded_runtimes

PRELUDE = """
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"test-main", 0, 0, 0)
import torch
torch.set_num_threads(2)

def named(name):
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            count += open(f"/proc/self/task/{tid}/comm").read().strip() == name
        except OSError:  # the thread ended meanwhile
            pass
    return count

def wait_for(check, what, limit=60.0):
    end = time.monotonic() + limit
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.01)

def parallel_op():
    torch.randn(1024, 1024).exp()
"""


def run_script(body: str) -> None:
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_release_team_ends_the_calling_threads_workers():
    run_script(
        """
        from expresslane.engine.openmp import release_team
        before = named("test-main")
        parallel_op()
        wait_for(lambda: named("test-main") == before + 1, "a parallel op starts a worker")
        assert release_team()
        wait_for(lambda: named("test-main") == before, "release_team ends the worker")
        parallel_op()  # a later region starts a team again
        wait_for(lambda: named("test-main") == before + 1, "the team comes back")
        """
    )


def test_a_served_engine_steps_in_the_only_team():
    """The thread that loaded the model keeps no workers once the step loop runs; the step
    loop's own team does the parallel work."""
    run_script(
        """
        import asyncio
        from expresslane.config import EngineConfig
        from expresslane.engine.async_engine import STEP_THREAD, AsyncEngine
        from expresslane.engine.engine import LLMEngine
        from expresslane.sampling_params import SamplingParams

        engine = LLMEngine(EngineConfig(calibrate=False, num_kv_blocks=64, seed=0))
        parallel_op()
        with_team = named("test-main")  # the loading thread's worker among them
        served = AsyncEngine(engine)

        async def one():
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            async for out in served.submit("def add(a, b):", params):
                pass
            return out

        assert asyncio.run(one()).num_output_tokens == 8
        wait_for(lambda: named("test-main") == with_team - 1, "the loading thread's team")
        wait_for(lambda: named(STEP_THREAD) == 2, "the step loop and its worker")
        served.shutdown()
        """
    )


def test_loaded_runtimes_reads_the_memory_map():
    maps = "\n".join(
        [
            "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libgomp.so.1.0.0",
            "7f10-7f20 r--p 00010000 08:01 1 /usr/lib/libgomp.so.1.0.0",
            "7f20-7f30 r-xp 00000000 08:01 2 /venv/torch/lib/libiomp5.so",
            "7f30-7f40 rw-p 00000000 00:00 0 ",
            "7f40-7f50 r-xp 00000000 08:01 3 /usr/lib/libc.so.6",
        ]
    )
    assert loaded_runtimes(maps) == ["/usr/lib/libgomp.so.1.0.0", "/venv/torch/lib/libiomp5.so"]
