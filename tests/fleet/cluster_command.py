"""`expresslane cluster FILE` started as a user starts it, for the tests that run the command
itself: up once it prints the ingress URL, stopped with SIGTERM after."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def running_cluster(cluster: Path) -> Iterator[list[str]]:
    """The command's output lines (growing while it runs), once its ingress is up."""
    cmd = [sys.executable, "-m", "expresslane.cli", "cluster", str(cluster)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "ingress at http://" in line:
                up.set()
        up.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert up.wait(900) and proc.poll() is None, "".join(lines[-40:])
        yield lines
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
