"""The agent workload's task set and the sandbox each task runs in.

A task set is a directory with a `tasks.json` and the tasks' files (the bundled one is
`tasks/`: six tiny Python modules, each with one bug and a test script of plain asserts):

    {"tasks": [{"id": "sum_range",                     # unique name
                "module": "sum_range.py",              # the file a code-block reply replaces
                "files": ["sum_range.py", "test_sum_range.py"],  # copied into the sandbox
                "instruction": "sum_range(a, b) should ...",     # the user's request
                "check": ["python", "test_sum_range.py"],        # exit code 0: fixed
                "timeout_s": 20}]}                     # optional, for each run of the check

A `Sandbox` is a fresh temporary copy of one task's files; `python` as the check's program
means this interpreter.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
OUTPUT_LIMIT = 4000  # characters of a check's output kept (its end)


@dataclass(frozen=True)
class Task:
    id: str
    module: str
    files: tuple[str, ...]
    instruction: str
    check: tuple[str, ...]
    root: Path
    timeout_s: float = 20.0


def load_tasks(root: Path = TASKS_DIR) -> list[Task]:
    data = json.loads((root / "tasks.json").read_text())
    tasks = [
        Task(
            id=t["id"],
            module=t["module"],
            files=tuple(t["files"]),
            instruction=t["instruction"],
            check=tuple(t["check"]),
            root=root,
            timeout_s=float(t.get("timeout_s", 20.0)),
        )
        for t in data["tasks"]
    ]
    if not tasks:
        raise ValueError(f"{root / 'tasks.json'}: no tasks")
    return tasks


def tail(text: str, limit: int = OUTPUT_LIMIT) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


class Sandbox:
    """A temporary directory holding a copy of one task's files."""

    def __init__(self, task: Task):
        self.task = task
        self.dir = Path(tempfile.mkdtemp(prefix=f"expresslane-agent-{task.id}-"))
        for name in task.files:
            shutil.copy2(task.root / name, self.dir / name)

    def path(self, rel: str) -> Path:
        """`rel` inside the sandbox; ValueError if it points outside."""
        p = (self.dir / rel).resolve()
        if not p.is_relative_to(self.dir.resolve()):
            raise ValueError(f"{rel!r} is outside the project")
        return p

    def read(self, rel: str) -> str:
        return self.path(rel).read_text()

    def write(self, rel: str, content: str) -> None:
        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)

    async def check(self) -> tuple[int | None, str]:
        """Run the task's check: (exit code, or None on timeout; the output's end)."""
        cmd = list(self.task.check)
        if cmd[0] == "python":
            cmd[0] = sys.executable
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            cwd=self.dir,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.task.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return None, f"timed out after {self.task.timeout_s:g} s"
        return proc.returncode, tail(out.decode("utf-8", "replace"))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
