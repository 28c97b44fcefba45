"""The `replay:FILE` workload: requests read from a JSONL file, one JSON object per line.

Format (one request per line; blank lines and lines starting with `#` are skipped):

    {"session": "s1",          # str, or null for a request with no session (default null)
     "turn": 0,                # order within the session (default: order in the file)
     "delay_s": 1.5,           # wait after the previous turn of the same session ends, e.g.
                               #   the agent's tool time (default 0; ignored on a first turn)
     "messages": [...],        # chat messages this turn ADDS to the conversation, or
     "input": "text" | [...],  #   Responses-style input (a string is one user message)
     "max_tokens": 128,        # output limit (default: --output-tokens, else 128)
     "extra": {...}}           # optional extra body fields, e.g. {"temperature": 0}

Each turn is sent with the session's whole conversation so far: the earlier turns' messages
and, after each, the assistant's reply text as the client received it. Sessions start in the
order of their first line; within a session turns run in `turn` order. With `--requests` or
`--duration` beyond one pass, the file is replayed again (session ids get a `#2`, `#3`, ...
suffix).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

from expresslane.bench.workloads import Session, Turn, WorkloadOptions, register


def _messages(obj: dict[str, Any], where: str) -> list[dict[str, Any]]:
    if "messages" in obj:
        messages = obj["messages"]
    elif isinstance(obj.get("input"), str):
        messages = [{"role": "user", "content": obj["input"]}]
    else:
        messages = obj.get("input")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{where}: give 'messages' (a list of objects) or 'input'")
    return messages


def load_sessions(path: str | Path, default_max_tokens: int) -> list[Session]:
    """Read a replay file into sessions (each null-session line is a session of its own)."""
    sessions: dict[str, list[tuple[int, int, Turn]]] = {}
    order: list[str | None] = []
    singles: list[Session] = []
    lines = Path(path).read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        turn = Turn(
            messages=_messages(obj, where),
            max_tokens=int(obj.get("max_tokens", default_max_tokens)),
            delay_s=float(obj.get("delay_s", 0.0)),
            extra=dict(obj.get("extra") or {}),
        )
        sid = obj.get("session")
        if sid is None:
            order.append(None)
            singles.append(Session(id=None, turns=[turn]))
            continue
        sid = str(sid)
        if sid not in sessions:
            sessions[sid] = []
            order.append(sid)
        sessions[sid].append((int(obj.get("turn", n)), n, turn))
    result: list[Session] = []
    single_iter = iter(singles)
    for sid in order:
        if sid is None:
            result.append(next(single_iter))
        else:
            turns = [t for _, _, t in sorted(sessions[sid], key=lambda x: (x[0], x[1]))]
            result.append(Session(id=sid, turns=turns))
    if not result:
        raise ValueError(f"{path}: no requests")
    return result


class ReplayWorkload:
    name = "replay"

    def __init__(self, path: str, options: WorkloadOptions):
        self.path = path
        self.loaded = load_sessions(path, options.max_tokens(128))

    def sessions(self) -> Iterator[Session]:
        for n in count(1):
            for s in self.loaded:
                sid = s.id if n == 1 or s.id is None else f"{s.id}#{n}"
                yield Session(id=sid, turns=s.turns)

    def default_requests(self) -> int | None:
        return sum(len(s.turns) for s in self.loaded)


@register("replay")
def _replay(arg: str | None, options: WorkloadOptions) -> ReplayWorkload:
    if not arg:
        raise ValueError("give the file: --workload replay:FILE")
    if options.response_format or options.tool_choice:
        raise ValueError(
            "--response-format and --tool-choice don't apply to replay (its lines "
            "may set response_format or tool_choice in 'extra')"
        )
    return ReplayWorkload(arg, options)
