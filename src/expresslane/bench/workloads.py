"""Workloads: what to send. A workload yields `Session`s, each a list of `Turn`s run in order.

A single request is a session of one turn. Workloads are looked up by name in `WORKLOADS`
(`--workload NAME` or `--workload NAME:ARG`); to add one, write a factory taking
`(arg, options)` and register it with `register("name")`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Turn:
    """One request: the messages it adds to its session's conversation, and its limits."""

    messages: list[dict[str, Any]]
    max_tokens: int
    delay_s: float = 0.0  # wait after the previous turn of the session ends (e.g. tool time)
    extra: dict[str, Any] = field(default_factory=dict)  # extra body fields (ignore_eos, ...)


@dataclass
class Session:
    id: str | None
    turns: list[Turn]


@dataclass
class WorkloadOptions:
    """The command line's workload settings; each workload uses the ones that apply to it."""

    seed: int = 0
    input_tokens: int = 256
    output_tokens: int = 128
    prefix_tokens: int = 0
    ignore_eos: bool = True


class Workload(Protocol):
    name: str

    def sessions(self) -> Iterator[Session]:
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


def make_workload(spec: str, options: WorkloadOptions) -> Workload:
    """'synthetic' or 'replay:FILE' -> a workload."""
    # Importing the modules registers the built-in workloads.
    from expresslane.bench import replay, synthetic  # noqa: F401

    name, _, arg = spec.partition(":")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    return WORKLOADS[name](arg or None, options)
