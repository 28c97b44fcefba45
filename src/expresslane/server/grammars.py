"""Grammars for what the API can ask of the output: JSON of a schema, any JSON object, and tool
calls in the model's own markup, with names and arguments constrained to the declared tools.

Grammars are llguidance Lark text (`sampling_params.Grammar`); JSON parts embed the schema with
`%json`. Between JSON tokens the model writes the whitespace it would write unconstrained
(compact `{"a": 1}` or indented over lines), at most one line break and `MAX_INDENT` spaces or
tabs at each place, so that a model cannot spin in whitespace. Special tokens (`<tool_call>`,
`[TOOL_CALLS]`) are token terminals, so plain text, which a regex matches byte by byte, can
never contain one: with `tool_choice` `none` or `auto` the model cannot open a call the grammar
did not declare. A marker that is plain text (a vocabulary without the token) ends the text
where it first occurs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from expresslane.sampling_params import Grammar

MAX_INDENT = 40
JSON_STYLE = {"whitespace_pattern": rf"(\r?\n)?[\x20\x09]{{0,{MAX_INDENT}}}"}
ANY = "(.|\\n)*"
Literal = Callable[[str], str]  # text -> Lark sequence (GrammarMatchers.literal)


@dataclass(frozen=True)
class CallMarkup:
    """How a tool-call format writes calls: `open` call (`sep` call)* `close`, each call
    `item_open` {"name": ..., args_key: {...}} `item_close`. `marker` starts call markup (plain
    text never contains it); `anchored`: calls only start the message (no text before them)."""

    marker: str = ""
    open: str = ""
    item_open: str = ""
    item_close: str = ""
    sep: str = ""
    close: str = ""
    args_key: str = "arguments"
    anchored: bool = False

    def write(self, bodies: list[str]) -> str:
        """Calls as this format writes them, from their JSON bodies."""
        items = self.sep.join(f"{self.item_open}{b}{self.item_close}" for b in bodies)
        return f"{self.open}{items}{self.close}"

    @property
    def text_rule(self) -> str:
        """Free text: anything without the marker (a special token never matches it)."""
        if not self.marker:
            return f"TEXT: /{ANY}/"
        marker = re.escape(self.marker).replace("/", "\\/")
        return f"TEXT: /{ANY}/ & ~/{ANY}{marker}{ANY}/"


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def json_schema(schema: dict, param: str) -> Grammar:
    """Output that is one JSON value valid against `schema`."""
    return Grammar(f"%llguidance {{}}\nstart: {_json(schema)}\n", param)


def tool_calls(
    markup: CallMarkup,
    tools: list[dict],
    choice: str | dict,
    parallel: bool,
    literal: Literal,
    content: dict | None = None,
) -> Grammar:
    """Calls of the declared `tools` ({"name", "parameters"}) as `choice` allows them
    ("none", "auto", "required", or {"name": ...}); `content`, a JSON schema the answer must
    follow when it is not a call."""
    text = _json(content) if content is not None else "TEXT"
    head = "%llguidance {}\n"
    if choice == "none":
        return Grammar(f"{head}start: {text}\n{markup.text_rule}\n", "tool_choice")
    if isinstance(choice, dict):
        tools = [t for t in tools if t["name"] == choice["name"]]
        parallel = False
    rules = _calls_rules(markup, tools, parallel, literal)
    start = "start: calls"
    if choice == "auto" and markup.anchored:
        start = f"start: {text} | calls"
    elif choice == "auto" and _is_token(literal(markup.marker)):
        start = f"start: {text} | TEXT calls"  # text cannot hold the token: it ends there
    elif choice == "auto":  # a plain-text marker: the text ends at its first occurrence
        rules += _after_marker_rules(markup, parallel, literal)
        start = f"start: {text} | lead after_marker"
    return Grammar(f"{head}{start}\n{rules}{markup.text_rule}\n", "tools")


def _is_token(lark: str) -> bool:
    return lark.startswith("<[") and " " not in lark


def _seq(literal: Literal, *parts: str) -> str:
    return " ".join(literal(p) for p in parts if p)


def _tail(markup: CallMarkup, parallel: bool, literal: Literal) -> str:
    """After the first call: more calls (when parallel), then the closing markup."""
    more = f"({_seq(literal, markup.sep)} call)*" if parallel else ""
    return f"{more} {_seq(literal, markup.close)}"


def _calls_rules(markup: CallMarkup, tools: list[dict], parallel: bool, literal: Literal) -> str:
    """`calls` (the whole markup), `call` and its JSON `body`."""
    return (
        f"calls: {_seq(literal, markup.open)} call {_tail(markup, parallel, literal)}\n"
        f"call: {_seq(literal, markup.item_open)} body {_seq(literal, markup.item_close)}\n"
        f"body: {_json(call_schema(tools, markup.args_key))}\n"
    )


def _after_marker_rules(markup: CallMarkup, parallel: bool, literal: Literal) -> str:
    """`lead` (text up to the plain-text marker, lazily) and `after_marker`, the calls' markup
    that follows it."""
    rest = _seq(literal, (markup.open or markup.item_open).removeprefix(markup.marker))
    first = f"{rest} call" if markup.open else f"{rest} body {_seq(literal, markup.item_close)}"
    return (
        f"lead[lazy]: /{ANY}/ {literal(markup.marker)}\n"
        f"after_marker: {first} {_tail(markup, parallel, literal)}\n"
    )


OPEN_ENDED = ("additionalProperties", "patternProperties", "unevaluatedProperties")
COMBINED = ("allOf", "anyOf", "oneOf", "$ref")


def call_schema(tools: list[dict], args_key: str) -> dict:
    """One call of any of `tools`: {"name": <declared>, args_key: <its parameters>}. Each tool's
    `$defs` move to the root (renamed per tool), so that their `$ref`s still resolve."""
    options, defs = [], {}
    for i, tool in enumerate(tools):
        params = _declared_only(tool.get("parameters") or {"type": "object"})
        local = {**params.pop("$defs", {}), **params.pop("definitions", {})}
        rename = {name: f"t{i}_{name}" for name in local}
        defs.update({rename[k]: _rewrite_refs(v, rename) for k, v in local.items()})
        args = _rewrite_refs(params, rename)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, args_key: args},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema: dict = {"anyOf": options} if len(options) != 1 else options[0]
    return {**schema, "$defs": defs} if defs else schema


def _declared_only(params: dict) -> dict:
    """Parameters that list their properties and say nothing of others take no others: a
    function's unknown argument is an error, and a model that strays past the last declared
    one (writing out the schema it was shown, say) would otherwise never close the call."""
    listed = "properties" in params and not any(k in params for k in OPEN_ENDED + COMBINED)
    return {**params, "additionalProperties": False} if listed else dict(params)


def _rewrite_refs(node, rename: dict[str, str]):
    if isinstance(node, dict):
        out = {k: _rewrite_refs(v, rename) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix) and ref[len(prefix) :] in rename:
                    out["$ref"] = "#/$defs/" + rename[ref[len(prefix) :]]
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, rename) for v in node]
    return node
