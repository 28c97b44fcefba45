"""Checks of what structured and tool-forcing requests returned, and their counts in a summary.

A completed request whose turn asked for an output format, or declared tools with a
`tool_choice`, gets `RequestRecord.output_check`, one of:

- output format: `valid` (JSON that validates against the schema; `json_object`: a JSON
  object), `schema_mismatch` (JSON that does not) or `not_json`;
- tools: `valid` (at least one call, each naming a declared tool, the named one for a named
  choice, with arguments that are a JSON object valid against that tool's `parameters`),
  `wrong_tool`, `bad_arguments` or `no_tool_call`.

Only the reply's tool calls count as calls: markup the server left in the text does not.
Schemas are checked with `jsonschema` (the `bench` extra), imported on the first check. The
synthetic modes need it; the agent workload runs without it, and then `valid` only means that
the arguments are a JSON object (the summary's `schemas_checked` is false).
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from typing import Any

from expresslane.bench.records import RequestRecord
from expresslane.bench.workloads import Reply, Turn

VALID, SCHEMA_MISMATCH, NOT_JSON = "valid", "schema_mismatch", "not_json"
WRONG_TOOL, BAD_ARGUMENTS, NO_TOOL_CALL = "wrong_tool", "bad_arguments", "no_tool_call"
FORCED = ("required", "named")

CHECK_DEFINITIONS = """\
Output checks (requests with an output format, or tools and a `tool_choice`), over completed
requests, by the client on the text and tool calls it received:

- **structured outputs** (requests with an output format): `parsed` = the text is JSON,
  `valid` = it validates against the schema (`json_object`: it is an object), `length` = the
  answer hit the output limit first (then it is rarely complete JSON).
- **tool calls** (requests with tools, by `tool_choice`): `tool_calls` = the reply holds a
  call, `valid` = every call names a declared tool (the named one) with arguments valid against
  its schema, `length` = the answer hit the output limit first. `required` and `named` force a
  call, so their `tool_calls` should equal their requests but for `length`. `forced` counts
  `required` and `named` together; its rates are the percentages in the summary table.
"""

_validators: dict[str, Any] = {}


def have_jsonschema() -> bool:
    return importlib.util.find_spec("jsonschema") is not None


def validates(instance: Any, schema: dict[str, Any]) -> bool:
    """The instance is valid against the schema (always, without jsonschema)."""
    key = json.dumps(schema, sort_keys=True)
    validator = _validators.get(key)
    if validator is None:
        if not have_jsonschema():
            return True
        import jsonschema

        cls = jsonschema.validators.validator_for(schema)
        validator = _validators[key] = cls(schema)
    return validator.is_valid(instance)


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def check_output(turn: Turn, reply: Reply) -> str | None:
    """What the reply holds against what the turn asked for (None: nothing to check)."""
    if turn.response_format:
        ok, value = _json(reply.text)
        if not ok:
            return NOT_JSON
        schema = turn.response_format.get("schema") or {"type": "object"}
        return VALID if validates(value, schema) else SCHEMA_MISMATCH
    if not turn.tools or turn.tool_choice is None:
        return None
    if not reply.tool_calls:
        return NO_TOOL_CALL
    params = {t["name"]: t.get("parameters") or {} for t in turn.tools}
    named = turn.tool_choice.get("name") if isinstance(turn.tool_choice, dict) else None
    for call in reply.tool_calls:
        if call.name not in params or named not in (None, call.name):
            return WRONG_TOOL
        ok, args = _json(call.arguments or "{}")
        if not ok or not isinstance(args, dict) or not validates(args, params[call.name]):
            return BAD_ARGUMENTS
    return VALID


def _counts(records: list[RequestRecord], called: bool) -> dict[str, Any]:
    n = Counter(r.output_check for r in records)
    out: dict[str, Any] = {"requests": len(records)}
    if called:
        out["tool_calls"] = len(records) - n[NO_TOOL_CALL]
    else:
        out["parsed"] = n[VALID] + n[SCHEMA_MISMATCH]
    out["valid"] = n[VALID]
    out["length"] = sum(r.finish_reason == "length" for r in records)
    out["valid_rate"] = n[VALID] / len(records)
    return out


def summarize_checks(records: list[RequestRecord]) -> dict[str, Any] | None:
    """Counts over the checked requests: `formats` {FORMAT: counts}, `tool_choice` {CHOICE:
    counts}, `structured` (every format) and `forced` (required and named) together; None if
    none was checked."""
    checked = [r for r in records if r.ok and r.output_check is not None]
    if not checked:
        return None
    formats: dict[str, list[RequestRecord]] = {}
    choices: dict[str, list[RequestRecord]] = {}
    for r in checked:
        if r.response_format:
            formats.setdefault(r.response_format, []).append(r)
        elif r.tool_choice:
            choices.setdefault(r.tool_choice, []).append(r)
    out: dict[str, Any] = {
        "schemas_checked": have_jsonschema(),
        "formats": {k: _counts(v, False) for k, v in formats.items()},
        "tool_choice": {k: _counts(v, True) for k, v in choices.items()},
    }
    if formats:
        out["structured"] = _counts([r for v in formats.values() for r in v], False)
    forced = [r for choice in FORCED for r in choices.get(choice, [])]
    if forced:
        out["forced"] = _counts(forced, True)
        out["forced"]["tool_call_rate"] = out["forced"]["tool_calls"] / len(forced)
    return out


def check_lines(checks: dict[str, Any]) -> list[str]:
    """report.md's lines for a run's checks."""
    lines = []
    for fmt, c in checks["formats"].items():
        lines.append(
            f"Structured outputs ({fmt}): {c['parsed']} of {c['requests']} parsed as JSON, "
            f"{c['valid']} valid, {c['length']} hit the output limit."
        )
    for choice, c in checks["tool_choice"].items():
        lines.append(
            f"tool_choice {choice}: {c['tool_calls']} of {c['requests']} returned a tool call, "
            f"{c['valid']} valid, {c['length']} hit the output limit."
        )
    return lines
