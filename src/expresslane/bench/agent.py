"""The `agent` workload (`--workload agent[:N]`): a small coding agent fixing one bug per task.

Each session is one task of the bundled set (`sandbox.py`; N tasks per run, cycling through
the set, default each task once). Its first request holds a system prompt naming the tools,
sent as OpenAI `tools` (`agent_tools.py`), and the task's instruction. Each later request
sends the whole conversation: when a reply has tool calls, they run (in a fresh temporary copy
of the task, or simulated with `--tool-time`) and their results are appended (Chat: the
assistant message with `tool_calls`, then `role: tool` messages; Responses: `function_call`
and `function_call_output` items). A reply without tool calls ends the task; if it holds a
fenced code block (```python), the last one replaces the task's module. At most
`--agent-max-turns` requests are sent (the last reply's tool calls still run). Then the task's
check runs once more: `accepted` is its exit code being 0. Requests don't send `ignore_eos`.

`tool_choice`: a turn needs a tool until the task is done, and the task is done when the tests
have passed since the last `write_file` (tasks fail as shipped, so a pass means a fix). Until
then nothing the model could answer ends the task well: it has not seen the code yet, or its
fix is untested, or the tests fail. Such turns send `tool_choice: "required"`; the turn after
the tests passed sends `"auto"`, leaving the model to answer. With `--tool-choice named`, a
forced turn names the tool when there is one next step: `read_file` until a file has been read,
`run_tests` after a `write_file` the tests have not run since; otherwise `"required"`. With
`--tool-choice auto` every turn sends `"auto"`. A call whose result is an error counts for
none of this. Simulated tools (`--tool-time`) pass the tests once a `write_file` came first.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from typing import Any

from expresslane.bench.agent_tools import TOOLS, RealTools, SimulatedTools, ToolTime
from expresslane.bench.records import TaskRecord
from expresslane.bench.sandbox import Task, load_tasks
from expresslane.bench.workloads import Reply, Turn, WorkloadOptions, register

SYSTEM = """\
You are a coding agent. You fix bugs in a small Python project in the current directory.
Tools:
- read_file(path): the text of a file
- write_file(path, content): replace the whole text of a file
- run_tests(): run the project's tests; exit code 0 means they pass
Read the code, write the fix, run the tests, then answer in one short sentence without calling
a tool. If you cannot call tools, answer with the whole fixed module in one ```python block."""

USER = """\
{instruction}
Files: {files}
The tests run with: {check}
Fix the bug so that the tests pass."""

DEFAULT_MAX_TOKENS = 1024
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def code_block(text: str) -> str | None:
    """The last fenced code block of a reply (plain or python), if any."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


class AgentSession:
    """One task: decides each next turn from the previous reply."""

    planned_turns = None  # known only as the replies come

    def __init__(
        self,
        sid: str,
        task: Task,
        tools: RealTools | SimulatedTools,
        max_turns: int,
        max_tokens: int,
        policy: str = "required",
    ):
        self.id: str | None = sid
        self.task = task
        self.tools = tools
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.policy = policy  # how forced turns are sent: required, named, or auto (never)
        self.turns = 0
        self.record = TaskRecord(task=task.id)
        self.has_read = False  # a read_file returned a file
        self.untested_write = False  # a write_file since the last run_tests
        self.passed = False  # the last run_tests passed, and nothing was written since

    def tool_choice(self) -> str | dict[str, str]:
        """What the next turn sends (see the module docstring)."""
        if self.policy == "auto" or self.passed:
            return "auto"
        if self.policy == "named":
            if not self.has_read:
                return {"name": "read_file"}
            if self.untested_write:
                return {"name": "run_tests"}
        return "required"

    def _note(self, name: str, output: str) -> None:
        """Track the task's progress from a tool call that ran."""
        if output.startswith("error:"):
            return
        if name == "read_file":
            self.has_read = True
        elif name == "write_file":
            self.untested_write, self.passed = True, False
        elif name == "run_tests":
            self.untested_write, self.passed = False, self.tools.tests_passed

    def _turn(self, messages: list[dict[str, Any]]) -> Turn:
        return Turn(
            messages=messages,
            max_tokens=self.max_tokens,
            tools=TOOLS,
            tool_choice=self.tool_choice(),
        )

    async def next_turn(self, reply: Reply | None) -> Turn | None:
        if reply is None:
            user = USER.format(
                instruction=self.task.instruction,
                files=", ".join(self.task.files),
                check=" ".join(self.task.check),
            )
            return self._turn(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
            )
        self.turns += 1
        start = time.perf_counter()
        try:
            if not reply.tool_calls:
                code = code_block(reply.text)
                if code is not None:
                    await self.tools.patch(self.task.module, code)
                self.record.stop = "answer" if code is None else "patch"
                return None
            results = []
            for call in reply.tool_calls:
                output = await self.tools.run(call)
                self._note(call.name, output)
                results.append({"role": "tool", "tool_call_id": call.id, "content": output})
            self.record.tool_calls += len(reply.tool_calls)
        finally:
            self.record.tool_s += time.perf_counter() - start
        if self.turns >= self.max_turns:
            self.record.stop = "max_turns"
            return None
        return self._turn(results)

    async def end(self, reason: str) -> TaskRecord:
        rec = self.record
        rec.stop = rec.stop or reason
        start = time.perf_counter()
        try:
            rec.accepted, rec.check_output = await self.tools.verify()
        finally:
            rec.verification_s = time.perf_counter() - start
            self.tools.close()
        return rec


class AgentWorkload:
    name = "agent"

    def __init__(self, tasks: list[Task], n: int | None, options: WorkloadOptions):
        self.tasks = tasks
        self.n = n or len(tasks)
        self.options = options
        self.tool_time = ToolTime.parse(options.tool_time) if options.tool_time else None
        if options.agent_max_turns < 1:
            raise ValueError("--agent-max-turns must be at least 1")
        if options.response_format:
            raise ValueError("--response-format is for the synthetic workload")

    def session(self, i: int) -> AgentSession:
        task = self.tasks[i % len(self.tasks)]
        rounds = i // len(self.tasks)
        sid = task.id if rounds == 0 else f"{task.id}#{rounds + 1}"
        if self.tool_time is None:
            tools: RealTools | SimulatedTools = RealTools(task)
        else:
            rng = random.Random(f"{self.options.seed}:{i}")  # per task: order-independent
            tools = SimulatedTools(task, self.tool_time, rng)
        max_tokens = self.options.max_tokens(DEFAULT_MAX_TOKENS)
        policy = self.options.tool_choice or "required"
        return AgentSession(sid, task, tools, self.options.agent_max_turns, max_tokens, policy)

    def sessions(self) -> Iterator[AgentSession]:
        return (self.session(i) for i in range(self.n))

    def default_requests(self) -> int | None:
        return None  # a run ends when its tasks are done


@register("agent")
def _agent(arg: str | None, options: WorkloadOptions) -> AgentWorkload:
    if arg is not None and not (arg.isdigit() and int(arg) > 0):
        raise ValueError(f"--workload agent:{arg}: expected agent or agent:N (tasks per run)")
    return AgentWorkload(load_tasks(), int(arg) if arg else None, options)
