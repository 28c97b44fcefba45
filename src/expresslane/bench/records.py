"""`RequestRecord`: what the client saw of one request, kept raw so any metric can be recomputed;
`TaskRecord`: what a task-shaped session (the agent workload) did besides its requests.

Times are seconds from the start of the run (`time.perf_counter()` at run start = 0).
`scheduled` is when the load model wanted the request sent (open loop: its Poisson arrival
time; closed loop: when a worker became free), so latencies measured from it include any time
the client itself was late (no coordinated omission).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class RequestRecord:
    scheduled: float
    sent: float | None = None  # first attempt's request written
    headers: float | None = None  # response headers (WebSocket: first event) of the last attempt
    first_token: float | None = None  # first streamed output chunk
    chunk_times: list[float] = field(default_factory=list)  # every streamed output chunk
    end: float | None = None  # stream finished (or failed)
    input_tokens: int | None = None  # from the server's usage
    cached_tokens: int | None = None
    output_tokens: int | None = None
    served_tier: str | None = None  # the response's service_tier
    status: int | None = None  # HTTP status (WebSocket: 200, or an error event's status)
    error: str | None = None
    retries: int = 0
    session: str | None = None
    turn: int | None = None
    finish_reason: str | None = None  # stop, length or tool_calls (Responses: mapped to these)
    response_format: str | None = None  # the output format asked for: json_object, json_schema
    tool_choice: str | None = None  # auto, required or named (None: not sent)
    output_check: str | None = None  # what `checks.py` found in the output (None: not checked)
    pool: str | None = None  # a fleet's x-expresslane-pool header (None: not a fleet)
    replica: str | None = None  # and its x-expresslane-replica

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    def reset_attempt(self) -> None:
        """Forget a failed attempt's response before a retry (`sent` stays the first send)."""
        self.headers = self.first_token = self.end = None
        self.chunk_times = []
        self.status = None
        self.error = None
        self.finish_reason = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class TaskRecord:
    """One agent task. The session fills what it did; the runner stamps `session`, `start` (the
    session's scheduled start) and `end` (once the session's `end()` returned, verification
    included). Its requests are the `RequestRecord`s with the same `session`."""

    task: str
    session: str | None = None
    start: float | None = None
    end: float | None = None
    stop: str | None = None  # answer, patch, max_turns, budget, deadline or error
    tool_calls: int = 0
    tool_s: float = 0.0  # tools run (or simulated delays)
    verification_s: float = 0.0  # the final check
    accepted: bool | None = None  # the check passed; None: not verified (simulated tools)
    check_output: str = ""  # the end of the final check's output

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TaskRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
