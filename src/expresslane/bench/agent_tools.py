"""The agent's tools: their specs, and two ways to run them.

- `RealTools`: each call runs for real in the task's sandbox (created on first use):
  `read_file(path)` returns the file's text, `write_file(path, content)` replaces it,
  `run_tests()` runs the task's check command (with its timeout) and returns the exit code
  and the output's end. `verify()` runs the check once more at the end.
- `SimulatedTools` (`--tool-time DIST`): each call sleeps a delay drawn from DIST and returns
  a canned result (`read_file`: the task's original file; `write_file`: an acknowledgement;
  `run_tests`: a note that nothing ran). Nothing is written, so nothing is verified
  (`accepted` is null): this mode models tool latency, not the agent's success.

Both keep `tests_passed`, the outcome of the last `run_tests` (the agent's `tool_choice`
depends on it): its exit code being 0; simulated, whether a `write_file` came before it (as if
every fix worked).

Errors in a call (unknown tool, bad arguments, a path outside the project) are returned to the
model as the tool's result, as an agent harness would.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass
from typing import Any

from expresslane.bench.sandbox import Sandbox, Task, tail
from expresslane.bench.workloads import ToolCall

_PATH = {"type": "string", "description": "path relative to the project directory"}
TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_file",
        "description": "Return the text of a file in the project.",
        "parameters": {"type": "object", "properties": {"path": _PATH}, "required": ["path"]},
    },
    {
        "name": "write_file",
        "description": "Replace the whole text of a file in the project.",
        "parameters": {
            "type": "object",
            "properties": {"path": _PATH, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
    {
        "name": "run_tests",
        "description": "Run the project's tests; returns the exit code (0: pass) and output.",
        "parameters": {"type": "object", "properties": {}},
    },
]


@dataclass(frozen=True)
class ToolTime:
    """A delay distribution in seconds: `const:S`, `uniform:A,B`, `exp:MEAN` or
    `lognormal:MEDIAN,SIGMA` (median seconds; SIGMA is the standard deviation of the log)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> ToolTime:
        kind, _, args = text.partition(":")
        try:
            nums = [float(x) for x in args.split(",")] if args else []
        except ValueError:
            nums = []
        arity = {"const": 1, "exp": 1, "uniform": 2, "lognormal": 2}
        if arity.get(kind) != len(nums) or any(x < 0 for x in nums):
            raise ValueError(
                f"--tool-time {text!r}: expected const:S, uniform:A,B, exp:MEAN or "
                "lognormal:MEDIAN,SIGMA (seconds, not negative)"
            )
        return cls(kind, *nums)

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exp":
            return rng.expovariate(1 / self.a) if self.a > 0 else 0.0
        return self.a * math.exp(self.b * rng.gauss(0.0, 1.0))


def arguments(call: ToolCall) -> dict[str, Any]:
    args = json.loads(call.arguments) if call.arguments.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("the arguments are not a JSON object")
    return args


class RealTools:
    def __init__(self, task: Task):
        self.task = task
        self._box: Sandbox | None = None
        self.tests_passed = False

    @property
    def box(self) -> Sandbox:
        if self._box is None:
            self._box = Sandbox(self.task)
        return self._box

    async def run(self, call: ToolCall) -> str:
        try:
            args = arguments(call)
            if call.name == "read_file":
                return self.box.read(str(args["path"]))
            if call.name == "write_file":
                content = str(args["content"])
                self.box.write(str(args["path"]), content)
                return f"wrote {len(content)} characters to {args['path']}"
            if call.name == "run_tests":
                code, output = await self.box.check()
                self.tests_passed = code == 0
                return f"exit code {code}\n{output}"
            return f"error: unknown tool {call.name!r}"
        except (ValueError, KeyError, OSError) as e:
            return f"error: {type(e).__name__}: {e}"

    async def patch(self, path: str, content: str) -> None:
        self.box.write(path, content)

    async def verify(self) -> tuple[bool | None, str]:
        code, output = await self.box.check()
        return code == 0, output

    def close(self) -> None:
        if self._box is not None:
            self._box.close()


class SimulatedTools:
    def __init__(self, task: Task, delay: ToolTime, rng: random.Random):
        self.task = task
        self.delay = delay
        self.rng = rng
        self.tests_passed = False
        self.wrote = False

    async def run(self, call: ToolCall) -> str:
        await asyncio.sleep(self.delay.sample(self.rng))
        try:
            args = arguments(call)
        except ValueError as e:
            return f"error: {e}"
        if call.name == "read_file":
            path = str(args.get("path"))
            if path not in self.task.files:
                return f"error: no such file {path!r}"
            return tail((self.task.root / path).read_text())
        if call.name == "write_file":
            self.wrote = True
            return f"wrote {len(str(args.get('content', '')))} characters to {args.get('path')}"
        if call.name == "run_tests":
            self.tests_passed = self.wrote
            return "(simulated tool: the tests were not run)"
        return f"error: unknown tool {call.name!r}"

    async def patch(self, path: str, content: str) -> None:
        pass

    async def verify(self) -> tuple[bool | None, str]:
        return None, ""

    def close(self) -> None:
        pass
