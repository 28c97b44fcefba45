"""The Responses API's tool kinds as the model sees them, and its calls as the client gets them.

The model is offered flat function tools (`Offered.functions`):
- a `function` tool as it is;
- a `namespace`'s tools each as `NAMESPACE.NAME`; a call comes back as a `function_call` (or
  `custom_tool_call`) naming `name` and `namespace` apart, and a replayed one is rendered under
  the flat name again, so the conversation reads as the model wrote it;
- a `custom` (freeform) tool as a function of one string, `input` (of its regular expression,
  where its format gives one; a Lark grammar is not enforced); its call comes back as a
  `custom_tool_call` whose `input` is that text;
- hosted tools (web search, file search, code interpreter, MCP servers, ...) are not run here:
  they are accepted, not offered, and named in the response's `tools_not_offered`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from expresslane.server.errors import invalid
from expresslane.server.prompt import new_id
from expresslane.server.response_builder import plain_call_item
from expresslane.server.schemas import ResponseCreateRequest, ToolChoiceFunction
from expresslane.server.state import ServerState
from expresslane.server.tool_choice import ToolSetup, output_schema, tool_setup
from expresslane.server.tool_parsers import ToolCall


def custom_parameters(fmt: dict | None) -> dict:
    """A custom tool's input as a function's parameters: one string."""
    text: dict = {"type": "string"}
    if fmt and fmt.get("type") == "grammar" and fmt.get("syntax") == "regex":
        text["pattern"] = f"^(?:{fmt.get('definition') or ''})$"  # JSON Schema's is a search
    return {
        "type": "object",
        "properties": {"input": text},
        "required": ["input"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class Origin:
    """Where a flat tool name came from."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass
class Offered:
    functions: list[dict] = field(default_factory=list)  # {"name", "description", "parameters"}
    origins: dict[str, Origin] = field(default_factory=dict)  # flat name -> where it came from
    not_offered: list[str] = field(default_factory=list)  # hosted tool types, as sent

    def call_item(self, call: ToolCall, status: str) -> dict:
        """The output item of a call the model made."""
        origin = self.origins.get(call.name, Origin(call.name))
        item = plain_call_item(call, status) | {"name": origin.name}
        if origin.custom:
            del item["arguments"]
            item |= {"id": new_id("ctc"), "type": "custom_tool_call"}
            item["input"] = custom_input(call.arguments)
        if origin.namespace is not None:
            item["namespace"] = origin.namespace
        return item


def flat_name(name: str, namespace: str | None) -> str:
    return name if namespace is None else f"{namespace}.{name}"


def offered(tools: list[dict]) -> Offered:
    """The request's tools (as `model_dump`ed) split into what the model is offered."""
    out = Offered()
    for i, tool in enumerate(tools):
        kind = tool["type"]
        if kind == "namespace":
            for j, inner in enumerate(tool["tools"]):
                _offer(out, inner, tool["name"], f"tools[{i}].tools[{j}].name")
        elif kind in ("function", "custom"):
            _offer(out, tool, None, f"tools[{i}].name")
        else:
            out.not_offered.append(kind)
    return out


def _offer(out: Offered, tool: dict, namespace: str | None, param: str) -> None:
    name = flat_name(tool["name"], namespace)
    if name in out.origins:
        raise invalid(f"Two tools are named {name!r}.", param=param, code="invalid_value")
    custom = tool["type"] == "custom"
    out.origins[name] = Origin(tool["name"], namespace, custom)
    parameters = custom_parameters(tool.get("format")) if custom else tool.get("parameters")
    fn = {"name": name, "parameters": parameters}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    out.functions.append(fn)


def custom_input(arguments: str) -> str:
    """A custom tool call's input text from the arguments the model wrote."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def responses_tool_setup(
    state: ServerState, req: ResponseCreateRequest
) -> tuple[ToolSetup, Any, Offered]:
    """The request's tools resolved into what the model is offered (`offered`) and the parser
    and grammar of its calls (`tool_choice.py`), and its tool_choice as the response echoes
    it."""
    tools = offered(echoed_tools(req))
    choice, forced = req.tool_choice, None
    if isinstance(choice, ToolChoiceFunction):
        choice, forced = None, flat_name(choice.name, choice.namespace)
    elif choice is not None and not isinstance(choice, str):
        choice = None  # a hosted tool: none runs here, so the model answers
    fmt = req.text.format if req.text is not None else None
    content = output_schema(fmt.type if fmt else None, fmt.schema_ if fmt else None, "text.format")
    setup = tool_setup(
        state,
        tools.functions,
        choice,
        forced,
        parallel=req.parallel_tool_calls is not False,
        content=content,
        param="tool_choice.name",
        content_param="text.format",
    )
    echo = req.tool_choice or "auto"
    return setup, echo if isinstance(echo, str) else echo.model_dump(exclude_none=True), tools


def echoed_tools(req: ResponseCreateRequest) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in req.tools or []]
