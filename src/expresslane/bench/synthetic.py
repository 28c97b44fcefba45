"""The `synthetic` workload: seeded random prompts of about `input_tokens` words.

Words come from a fixed vocabulary of common English and code words, so prompt lengths mean
roughly the same number of tokens with any tokenizer. Every request asks for `output_tokens`
(default 128) tokens with `ignore_eos` (unless turned off) so output lengths are fixed. With
`prefix_tokens`, every prompt starts with the same shared prefix (to exercise prefix caching).
Prompts never repeat within one benchmark invocation: the random state carries over from run
to run.

Structured and tool-forcing requests (`--response-format`, `--tool-choice`): each prompt ends
with an instruction to review the text and report findings, and the request asks for them in
`FINDINGS` (a summary and at most three findings, every string bounded so that a complete
answer fits in the default 256 output tokens of these modes) as its output format, or as the
arguments of the `report_findings` tool, declared with a second tool (`search_code`) so that
`required` leaves the model a choice and `named` forces `report_findings`. Tool requests send
`parallel_tool_calls: false`: one call each. `checks.py` counts the outputs that parse and
validate.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from expresslane.bench.workloads import Session, Turn, WorkloadOptions, register

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or an at not but "
    "have all can one more time when will about which their there would what some into other "
    "than then them these so people only new first also after over well way even because any "
    "most us work through back good give under know between system model request server "
    "token cache batch queue latency memory thread stream value result error number string "
    "list table index user agent tool call answer question plan step data file line word "
    "def class return import from self none true false if else elif for while try except "
    "raise with yield lambda async await print len range dict int str float bool append "
    "json http path config args kwargs init main test assert open read write close update"
)
VOCABULARY: tuple[str, ...] = tuple(_WORDS.split())


def _string(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


FINDING = {
    "type": "object",
    "properties": {
        "title": _string(40),
        "severity": {"type": "string", "enum": ["low", "medium", "high"]},
        "line": {"type": "integer", "minimum": 1, "maximum": 9999},
        "detail": _string(80),
    },
    "required": ["title", "severity", "line", "detail"],
    "additionalProperties": False,
}
FINDINGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "summary": _string(80),
        "findings": {"type": "array", "items": FINDING, "maxItems": 3},
    },
    "required": ["summary", "findings"],
    "additionalProperties": False,
}
REPORT_TOOL = "report_findings"
TOOLS: list[dict[str, Any]] = [
    {
        "name": REPORT_TOOL,
        "description": "Report the findings of a review.",
        "parameters": FINDINGS,
    },
    {
        "name": "search_code",
        "description": "Search the code base for a query.",
        "parameters": {
            "type": "object",
            "properties": {"query": _string(80)},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
]
ASK_JSON = "Review the text above and report your findings as JSON."
ASK_TOOL = f"Review the text above and report your findings with the {REPORT_TOOL} tool."
STRUCTURED_MAX_TOKENS = 256


def response_format(kind: str) -> dict[str, Any]:
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": "findings", "schema": FINDINGS, "strict": True}


def tool_choice(kind: str) -> str | dict[str, str]:
    return {"name": REPORT_TOOL} if kind == "named" else kind


class SyntheticWorkload:
    name = "synthetic"

    def __init__(self, options: WorkloadOptions):
        self.options = options
        self.rng = random.Random(options.seed)
        # The shared prefix has its own stream so it doesn't depend on how many prompts ran.
        prefix_rng = random.Random(f"prefix-{options.seed}")
        self.prefix = " ".join(prefix_rng.choices(VOCABULARY, k=options.prefix_tokens))

    def prompt(self) -> str:
        words = self.rng.choices(VOCABULARY, k=max(self.options.input_tokens, 1))
        body = " ".join(words)
        return f"{self.prefix} {body}" if self.prefix else body

    def turn(self) -> Turn:
        o = self.options
        extra: dict[str, Any] = {"ignore_eos": True} if o.ignore_eos else {}
        prompt = self.prompt()
        if o.response_format is None and o.tool_choice is None:
            return Turn([{"role": "user", "content": prompt}], o.max_tokens(128), extra=extra)
        ask = ASK_TOOL if o.tool_choice else ASK_JSON
        content = f"{prompt}\n\n{ask}"
        turn = Turn([{"role": "user", "content": content}], o.max_tokens(STRUCTURED_MAX_TOKENS))
        turn.extra = extra
        if o.response_format:
            turn.response_format = response_format(o.response_format)
        else:
            assert o.tool_choice is not None
            turn.tools, turn.tool_choice = TOOLS, tool_choice(o.tool_choice)
            extra["parallel_tool_calls"] = False
        return turn

    def sessions(self) -> Iterator[Session]:
        while True:
            yield Session(id=None, turns=[self.turn()])

    def default_requests(self) -> int | None:
        return 100


@register("synthetic")
def _synthetic(arg: str | None, options: WorkloadOptions) -> SyntheticWorkload:
    if arg:
        raise ValueError("the synthetic workload takes no argument; use --input-tokens etc.")
    if options.response_format and options.tool_choice:
        raise ValueError("give --response-format or --tool-choice, not both")
    return SyntheticWorkload(options)
