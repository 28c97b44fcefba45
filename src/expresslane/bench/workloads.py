"""Workloads: what to send. A workload yields sessions; the runner asks each for its next
`Turn`, handing it the previous `Reply`, until it says None.

`Session` has fixed turns (a single request is a session of one turn); a session whose next
turn depends on the reply (the agent workload) implements `SessionLike` itself. Messages are
Chat-shaped (`target.py` turns them into Responses input items). Workloads are looked up by
name in `WORKLOADS` (`--workload NAME` or `--workload NAME:ARG`); to add one, write a factory
taking `(arg, options)` and register it with `register("name")`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from expresslane.bench.records import TaskRecord


@dataclass
class Turn:
    """One request: the messages it adds to its session's conversation, and its limits."""

    messages: list[dict[str, Any]]
    max_tokens: int
    delay_s: float = 0.0  # wait after the previous turn of the session ends (e.g. tool time)
    extra: dict[str, Any] = field(default_factory=dict)  # extra body fields (ignore_eos, ...)
    tools: list[dict[str, Any]] | None = None  # function specs: {"name", "description", ...}
    # {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"} (the
    # Responses `text.format` shape; `target.py` nests it for Chat)
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, str] | None = None  # "auto", "required" or {"name": TOOL}

    @property
    def format_kind(self) -> str | None:
        """The output format asked for: "json_object", "json_schema" or None."""
        return self.response_format["type"] if self.response_format else None

    @property
    def choice_kind(self) -> str | None:
        """The tool_choice sent: "auto", "required", "named" or None (not sent)."""
        return "named" if isinstance(self.tool_choice, dict) else self.tool_choice


@dataclass
class ToolCall:
    id: str  # Chat: the tool call's id; Responses: its call_id
    name: str
    arguments: str  # JSON text, as streamed


@dataclass
class Reply:
    """What the client received for one turn: the visible text and any tool calls."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message that continues the conversation (Chat-shaped)."""
        if not self.tool_calls:
            return {"role": "assistant", "content": self.text}
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.tool_calls
        ]
        return {"role": "assistant", "content": self.text or None, "tool_calls": calls}


class SessionLike(Protocol):
    id: str | None

    @property
    def planned_turns(self) -> int | None:
        """The number of turns if known up front (the runner reserves them at once), else
        None (the runner reserves each turn as it starts)."""
        ...

    async def next_turn(self, reply: Reply | None) -> Turn | None:
        """The next request given the previous one's reply (None before the first); None
        ends the session."""
        ...

    async def end(self, reason: str) -> TaskRecord | None:
        """Called once when the session is over: reason is "done" (next_turn said None),
        "budget" or "deadline" (the run stopped it) or "error" (a request failed). May return
        a task record (the runner stamps its start, end and session)."""
        ...


@dataclass
class Session:
    """A session with fixed turns, sent in order whatever the replies."""

    id: str | None
    turns: list[Turn]
    _next: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def planned_turns(self) -> int | None:
        return len(self.turns)

    async def next_turn(self, reply: Reply | None) -> Turn | None:
        if self._next >= len(self.turns):
            return None
        self._next += 1
        return self.turns[self._next - 1]

    async def end(self, reason: str) -> TaskRecord | None:
        return None


@dataclass
class WorkloadOptions:
    """The command line's workload settings; each workload uses the ones that apply to it."""

    seed: int = 0
    input_tokens: int = 256
    output_tokens: int | None = None  # None: the workload's default
    prefix_tokens: int = 0
    ignore_eos: bool = True
    agent_max_turns: int = 6
    tool_time: str | None = None  # agent: simulate tools with this delay distribution
    response_format: str | None = None  # synthetic: "json_object" or "json_schema"
    tool_choice: str | None = None  # "auto", "required" or "named" (synthetic, agent)

    def max_tokens(self, default: int) -> int:
        return self.output_tokens if self.output_tokens is not None else default


class Workload(Protocol):
    name: str

    def sessions(self) -> Iterator[SessionLike]:
        """Sessions for one run, possibly without end (the runner stops at its budget)."""
        ...

    def default_requests(self) -> int | None:
        """Requests per run when neither --requests nor --duration is given."""
        ...


WorkloadFactory = Callable[[str | None, WorkloadOptions], Workload]
WORKLOADS: dict[str, WorkloadFactory] = {}


def register(name: str) -> Callable[[WorkloadFactory], WorkloadFactory]:
    def deco(factory: WorkloadFactory) -> WorkloadFactory:
        WORKLOADS[name] = factory
        return factory

    return deco
