"""Prompt rendering: Responses input items and chat messages -> chat-template messages -> text.

Template messages are what Hugging Face chat templates expect: `{"role", "content": str}`,
assistant turns with `tool_calls: [{"id", "type": "function", "function": {"name",
"arguments": dict}}]`, and `{"role": "tool", "tool_call_id", "name", "content"}` results.
`developer` becomes `system`; an assistant turn's reasoning is its `thinking` (the name
gpt-oss's template reads). A `function_call` item joins the assistant turn before it, so a
replayed conversation renders exactly as the model wrote it and the KV prefix cache hits.
Every string a client sent is rendered marked, so that its special-token text stays text
(`user_text.py`): `render` gives a `ChatPrompt`, which the tokenizer encodes that way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from expresslane.errors import ExpresslaneError
from expresslane.server.errors import from_engine_error, invalid
from expresslane.server.tool_parsers import ToolCall
from expresslane.user_text import ChatPrompt

TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
MEDIA_PARTS = {"input_image", "input_file", "input_audio", "image_url", "file"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parse_arguments(text: str) -> dict | str:
    """Arguments as a dict for the template (it renders them as JSON), or the raw text."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text
    return value if isinstance(value, dict) else text


def template_tools(tools: list[dict]) -> list[dict]:
    """Function tools in the nested form chat templates expect."""
    out = []
    for t in tools:
        fn = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def content_text(content: Any, param: str, allow_none: bool = False) -> str:
    """The text of a message's content: a string, or a list of text parts."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(
            f"'{param}' must be a string or a list of content parts.",
            param=param,
            code="invalid_type",
        )
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in MEDIA_PARTS:
            raise invalid(
                f"'{p}' is a {kind} part, but this model reads text only.",
                param=p + ".type",
                code="unsupported_content_type",
            )
        else:
            raise invalid(
                f'\'{p}\' must be a text part like {{"type": "input_text", "text": "..."}}.',
                param=p,
                code="invalid_value",
            )
    return "\n".join(texts)


def _require_str(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise invalid(
            f"'{param}.{key}' is required and must be a non-empty string.",
            param=f"{param}.{key}",
            code="invalid_value" if key in item else "missing_required_parameter",
        )
    return value


def _tool_names(messages: list[dict]) -> dict[str, str]:
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}


def _add_call(messages: list[dict], call_id: str, name: str, arguments: str) -> None:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": parse_arguments(arguments)},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def responses_input(
    input: str | list[dict],
    context: list[dict],
    param: str = "input",
    unseal: Callable[[str, str], str] | None = None,
) -> tuple[list[dict], list[dict]]:
    """Validate Responses input; return (input items as stored/listed, template messages).

    `context` holds the earlier conversation (from previous_response_id), used to check that
    every function_call_output answers a known call; `unseal(token, param)` opens a reasoning
    item's `encrypted_content` (`sealing.py`)."""
    if isinstance(input, str) and input:
        input = [{"type": "message", "role": "user", "content": input}]
    if not input:
        raise invalid(
            "'input' must not be empty: send a string or at least one input item.",
            param=param,
            code="empty_input",
        )
    items: list[dict] = []
    messages: list[dict] = []
    names = _tool_names(context)  # call_id -> function name, growing as calls are read
    thinking = ""
    for i, item in enumerate(input):
        p = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{p}' must be an object (an input item).", param=p, code="invalid_type")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "reasoning":
            thinking = _reasoning_text(item, p, unseal)  # the next assistant turn's
            continue
        read = _INPUT_ITEMS.get(kind)
        if read is None:
            raise invalid(
                f"'{p}.type' {kind!r} is not supported; use message, function_call, "
                "function_call_output, custom_tool_call or custom_tool_call_output items.",
                param=f"{p}.type",
                code="unsupported_item_type",
            )
        items.append(read(item, p, messages, names))
        if thinking and messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("thinking", thinking)
        thinking = ""
    return items, messages


def _reasoning_text(item: dict, p: str, unseal: Callable[[str, str], str] | None) -> str:
    """A replayed reasoning item's text: sealed in its `encrypted_content`, or its
    reasoning_text parts (plain text only)."""
    sealed = item.get("encrypted_content")
    if sealed is not None:
        if not isinstance(sealed, str) or unseal is None:
            raise invalid(f"'{p}.encrypted_content' must be a string.", param=p)
        return unseal(sealed, f"{p}.encrypted_content")
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise invalid(
            f"'{p}.content' must be a list of reasoning_text parts.",
            param=f"{p}.content",
            code="invalid_type",
        )
    return "".join(part.get("text", "") for part in parts if isinstance(part, dict))


def _input_message(item: dict, p: str, messages: list[dict], names: dict) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid(
            f"'{p}.role' must be one of user, assistant, system, developer; got {role!r}.",
            param=f"{p}.role",
            code="invalid_value",
        )
    text = content_text(item.get("content"), f"{p}.content")
    part = {"type": "output_text" if role == "assistant" else "input_text", "text": text}
    if role == "assistant":
        part["annotations"] = []
    messages.append({"role": "system" if role == "developer" else role, "content": text})
    return {
        "type": "message",
        "id": item.get("id") or new_id("msg"),
        "role": role,
        "content": [part],
        "status": "completed",
    }


def _input_function_call(item: dict, p: str, messages: list[dict], names: dict) -> dict:
    """A replayed call (`custom_tool_call` too: its input is the one string argument the
    model wrote), under the flat name the model was offered (`response_tools.py`)."""
    call_id = _require_str(item, "call_id", p)
    name = _require_str(item, "name", p)
    custom = item.get("type") == "custom_tool_call"
    if custom:
        arguments = json.dumps({"input": _require_str(item, "input", p)}, ensure_ascii=False)
    else:
        arguments = _require_str(item, "arguments", p)
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise invalid(f"'{p}.namespace' must be a string.", param=f"{p}.namespace")
    flat = name if namespace is None else f"{namespace}.{name}"
    _add_call(messages, call_id, flat, arguments)
    names[call_id] = flat
    kept = {"input": item["input"]} if custom else {"arguments": arguments}
    if namespace is not None:
        kept["namespace"] = namespace
    return {
        "type": item["type"] if custom else "function_call",
        "id": item.get("id") or new_id("ctc" if custom else "fc"),
        "call_id": call_id,
        "name": name,
        **kept,
        "status": "completed",
    }


def _input_function_call_output(item: dict, p: str, messages: list[dict], names: dict) -> dict:
    call_id = _require_str(item, "call_id", p)
    if call_id not in names:
        raise invalid(
            f"No function call with call_id {call_id!r} precedes '{p}'; send "
            "the function_call item too, or use previous_response_id.",
            param=f"{p}.call_id",
            code="invalid_value",
        )
    output = item.get("output")
    text = content_text(output, f"{p}.output")
    messages.append(
        {"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": text}
    )
    custom = item.get("type") == "custom_tool_call_output"
    return {
        "type": item["type"] if custom else "function_call_output",
        "id": item.get("id") or new_id("ctco" if custom else "fco"),
        "call_id": call_id,
        "output": output,
        "status": "completed",
    }


_INPUT_ITEMS = {  # Responses input item type -> its reader
    "message": _input_message,
    "function_call": _input_function_call,
    "function_call_output": _input_function_call_output,
    "custom_tool_call": _input_function_call,
    "custom_tool_call_output": _input_function_call_output,
}


def chat_messages(raw: list[dict]) -> list[dict]:
    """Validate Chat Completions messages into template messages."""
    messages: list[dict] = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise invalid(
                f"'{p}.role' must be one of system, developer, user, assistant, tool; "
                f"got {role!r}.",
                param=f"{p}.role",
                code="invalid_value",
            )
        text = content_text(m.get("content"), f"{p}.content", allow_none=role == "assistant")
        msg: dict = {"role": "system" if role == "developer" else role, "content": text}
        thinking = m.get("reasoning_content") if role == "assistant" else None
        if isinstance(thinking, str) and thinking:
            msg["thinking"] = thinking  # where gpt-oss's template reads a turn's reasoning
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise invalid(f"'{p}.tool_calls' must be a list.", param=f"{p}.tool_calls")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                cp = f"{p}.tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise invalid(f"'{cp}.function' is required.", param=f"{cp}.function")
                name = _require_str(fn, "name", f"{cp}.function")
                args = _require_str(fn, "arguments", f"{cp}.function")
                call_id = c.get("id") if isinstance(c.get("id"), str) else new_id("call")
                msg["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": parse_arguments(args)},
                    }
                )
        if role == "tool":
            call_id = _require_str(m, "tool_call_id", p)
            msg["tool_call_id"] = call_id
            name = _tool_names(messages).get(call_id) or m.get("name")
            if name:
                msg["name"] = name
        messages.append(msg)
    return messages


def output_messages(text: str, calls: list[ToolCall], reasoning: str = "") -> list[dict]:
    """The assistant turn a response produced, as template messages."""
    msg: dict = {"role": "assistant", "content": text}
    if reasoning:
        msg["thinking"] = reasoning
    if calls:
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": parse_arguments(c.arguments)},
            }
            for c in calls
        ]
    return [msg]


def render(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    param: str = "input",
    effort: str | None = None,
) -> ChatPrompt:
    """The prompt for `messages`, its client strings kept text (`user_text.py`); `effort` (a
    request's reasoning effort) reaches the template as `reasoning_effort`."""
    return ChatPrompt.from_marked(render_marked(tokenizer, messages, tools, param, effort))


def render_marked(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    param: str = "input",
    effort: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's text, every client string in it marked (`SpecialTexts.mark_all`)."""
    if tokenizer is None:
        raise invalid(
            "This model has no tokenizer, so it cannot render chat messages; use "
            "POST /v1/completions with token ids.",
            param=param,
        )
    specials = tokenizer.special_texts
    try:
        extra = {"reasoning_effort": effort} if effort is not None else {}
        return tokenizer.apply_chat_template(
            specials.mark_all(messages),
            tools=specials.mark_all(tools) or None,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except ExpresslaneError as e:
        error = from_engine_error(e)
        error.param = param if error.param == "messages" else error.param
        raise error from e
