"""A request's tools, tool_choice and output format, resolved into the parser that reads calls
back from the text and the grammar that constrains decoding (`grammars.py`).

Both Chat Completions and Responses come here, so a named choice, `required`, `none`,
`parallel_tool_calls: false` and a JSON output format mean the same on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from expresslane.sampling_params import Grammar
from expresslane.server.errors import invalid
from expresslane.server.grammars import json_schema, tool_calls
from expresslane.server.harmony_grammar import harmony_grammar
from expresslane.server.state import ServerState
from expresslane.server.tool_parsers import ToolParser


@dataclass
class ToolSetup:
    tools: list[dict]  # {"name", "description", "parameters", ...}
    choice: str | dict  # "none" | "auto" | "required" | {"name": ...}
    parser: ToolParser | None  # None: calls are not parsed (no tools, or "none")
    grammar: Grammar | None
    keep_special_tokens: bool = False  # a parser reads markers that are special tokens

    @property
    def declared(self) -> set[str]:
        """The names a call may have: the named tool alone when the choice names one."""
        if isinstance(self.choice, dict):
            return {self.choice["name"]}
        return {t["name"] for t in self.tools}


def output_schema(kind: str | None, schema: dict | None, param: str) -> dict | None:
    """The JSON schema an output format asks for ("text" or None: none)."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if not isinstance(schema, dict):
        raise invalid(f"'{param}.schema' must be a JSON schema object.", param=f"{param}.schema")
    return schema


def tool_setup(
    state: ServerState,
    tools: list[dict],
    choice: str | None,
    forced: str | None,
    *,
    parallel: bool,
    content: dict | None,
    param: str,
    content_param: str,
) -> ToolSetup:
    """`choice` is "none"/"auto"/"required" or None (the default), `forced` a named tool;
    `content` the JSON schema of a non-call answer. Errors name `param` (the tool_choice
    field) and `content_param` (the output format field)."""
    names = {t["name"] for t in tools}
    if forced is not None and forced not in names:
        raise invalid(
            f"tool_choice names the function {forced!r}, which is not in 'tools'.",
            param=param,
            code="invalid_value",
        )
    if choice == "required" and not tools:
        raise invalid(
            "tool_choice 'required' needs at least one tool in 'tools'.",
            param="tool_choice",
            code="invalid_value",
        )
    chosen: str | dict = {"name": forced} if forced else (choice or "auto")
    parser = state.tool_parser if tools and chosen != "none" else None
    grammar = None
    if state.reasoning_parser.name == "harmony":
        grammar = harmony_grammar(tools, chosen, state.grammar_literal, content, content_param)
        return ToolSetup(tools, chosen, parser, grammar, keep_special_tokens=True)
    if tools:
        markup = state.tool_parser.markup
        parallel = parallel and _knows_calls(state)
        grammar = tool_calls(markup, tools, chosen, parallel, state.grammar_literal, content)
    if grammar is None and content is not None:
        grammar = json_schema(content, content_param)
    keep = parser is not None and parser.needs_special_tokens
    keep = keep or state.reasoning_parser.needs_special_tokens
    return ToolSetup(tools, chosen, parser, grammar, keep)


def _knows_calls(state: ServerState) -> bool:
    """Whether the model's own template renders tools. One that cannot is shown one call in
    the system message (`tool_prompt.py`) and gets at most one: after a call such a model
    writes a newline on its way to prose, which the grammar would read as the start of the
    next call, so that it repeats the call until it runs out of tokens."""
    return state.tokenizer is None or state.tokenizer.renders_tools
