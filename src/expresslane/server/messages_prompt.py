"""Anthropic Messages -> the chat-template messages `prompt.py` renders.

`system` becomes the system message; a user turn's `tool_result` blocks become `tool`
messages (in order, the text around them user messages); an assistant turn's `tool_use`
blocks its `tool_calls`, its `thinking` block its reasoning (`thinking`, the name gpt-oss's
template reads). So a conversation that replays what the server wrote renders as the model
wrote it, and the prefix cache hits. Tools become the function tools of `tool_choice.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from expresslane.server.errors import invalid
from expresslane.server.messages_schema import CountTokensRequest, TextBlock
from expresslane.server.prompt import render, template_tools
from expresslane.user_text import ChatPrompt

UNSUPPORTED = {"image", "document", "search_result", "container_upload", "server_tool_use"}
Check = Callable[[dict, str], None]  # verifies a thinking block sent back (signature)


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(b.text for b in system) or None


def function_tools(body: CountTokensRequest) -> list[dict]:
    """The request's tools as `tool_choice.tool_setup` takes them."""
    return [
        {"name": t.name, "description": t.description, "parameters": t.input_schema}
        for t in body.tools or []
    ]


def template_messages(body: CountTokensRequest, check: Check | None = None) -> list[dict]:
    """Validate the Messages conversation into template messages."""
    messages: list[dict] = []
    system = system_text(body.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> tool name
    for i, m in enumerate(body.messages):
        p = f"messages[{i}]"
        role = m.get("role")
        if role == "user":
            _user(m.get("content"), p, messages, names)
        elif role == "assistant":
            messages.append(_assistant(m.get("content"), p, names, check))
        else:
            raise invalid(
                f"'{p}.role' must be 'user' or 'assistant'; got {role!r}.", param=f"{p}.role"
            )
    if body.messages[-1].get("role") != "user":
        raise invalid(
            "The last message must be a user message: this server does not continue an "
            "assistant prefill.",
            param=f"messages[{len(body.messages) - 1}].role",
        )
    return messages


def _blocks(content: Any, p: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"'{p}' must be a string or a list of content blocks.", param=p)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise invalid(f"'{p}[{j}]' must be a content block with a 'type'.", param=f"{p}[{j}]")
        if kind in UNSUPPORTED or kind.endswith("_tool_result"):
            raise invalid(
                f"'{p}[{j}]' is a {kind} block, but this server reads text and tool blocks only.",
                param=f"{p}[{j}].type",
            )
    return content


def _text(block: dict, p: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"'{p}.text' must be a string.", param=f"{p}.text")
    return text


def _user(content: Any, p: str, messages: list[dict], names: dict[str, str]) -> None:
    texts: list[str] = []

    def flush() -> None:
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for j, block in enumerate(_blocks(content, f"{p}.content")):
        bp = f"{p}.content[{j}]"
        if block["type"] == "text":
            texts.append(_text(block, bp))
        elif block["type"] == "tool_result":
            flush()
            messages.append(_tool_result(block, bp, names))
        else:
            raise invalid(
                f"'{bp}' is a {block['type']} block, which a user message cannot hold.",
                param=f"{bp}.type",
            )
    flush()


def _tool_result(block: dict, p: str, names: dict[str, str]) -> dict:
    call_id = block.get("tool_use_id")
    if call_id not in names:
        raise invalid(
            f"'{p}.tool_use_id' ({call_id!r}) answers no tool_use block of an earlier "
            "assistant message.",
            param=f"{p}.tool_use_id",
        )
    content = block.get("content", "")
    parts = _blocks(content, f"{p}.content")
    text = "\n".join(_text(b, f"{p}.content[{k}]") for k, b in enumerate(parts))
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": text}


def _assistant(content: Any, p: str, names: dict[str, str], check: Check | None) -> dict:
    texts: list[str] = []
    msg: dict = {"role": "assistant", "content": ""}
    for j, block in enumerate(_blocks(content, f"{p}.content")):
        bp = f"{p}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, bp))
        elif kind == "tool_use":
            call = _tool_use(block, bp)
            names[call["id"]] = call["function"]["name"]
            msg.setdefault("tool_calls", []).append(call)
        elif kind == "thinking":
            if check is not None:
                check(block, bp)
            msg["thinking"] = msg.get("thinking", "") + str(block.get("thinking", ""))
        elif kind != "redacted_thinking":  # encrypted elsewhere: nothing to render here
            raise invalid(
                f"'{bp}' is a {kind} block, which an assistant message cannot hold.",
                param=f"{bp}.type",
            )
    msg["content"] = "".join(texts)
    return msg


def _tool_use(block: dict, p: str) -> dict:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    for field, value in (("id", call_id), ("name", name)):
        if not isinstance(value, str) or not value:
            raise invalid(f"'{p}.{field}' must be a non-empty string.", param=f"{p}.{field}")
    if not isinstance(args, dict):
        raise invalid(f"'{p}.input' must be an object.", param=f"{p}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def renders_tools(body: CountTokensRequest) -> bool:
    """Whether the template shows the tools: as on Chat, not for `tool_choice: none`."""
    none = body.tool_choice is not None and body.tool_choice.type == "none"
    return bool(body.tools) and not none


def messages_prompt(
    tokenizer, body: CountTokensRequest, effort: str | None, check: Check | None = None
) -> ChatPrompt:
    """The prompt of a create (or count_tokens) request: one function for both, so that the
    count is the create's `input_tokens`."""
    tools = template_tools(function_tools(body)) if renders_tools(body) else None
    return render(tokenizer, template_messages(body, check), tools, "messages", effort)
