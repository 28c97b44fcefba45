"""Tools for chat templates that cannot render them.

Whether a model's chat template renders tools is decided once per server, by rendering a probe
conversation whose tool has a sentinel name (`renders_tools`). When it does not, the request's
tools and the call format go into the system message (`TOOLS_PROMPT`, the one wording, merged
into an existing system message or put first), earlier calls are written back as the markup
the model writes (so a replayed turn renders as it was written) and tool results become user
turns in `<tool_response>` tags. The markup is plain text that the tool grammar forces
(`grammars.py`), so this works whether or not the vocabulary has the parser's markers.
"""

from __future__ import annotations

import json

from expresslane.errors import ExpresslaneError
from expresslane.server.grammars import CallMarkup

TOOLS_PROMPT = """# Tools

You can call these functions (JSON schemas, one per line):
<tools>
{tools}
</tools>

To call a function, write:
{call}"""
PROBE_NAME = "expresslane_probe_function"


def renders_tools(tokenizer) -> bool:
    """Whether the chat template shows the model the tools it is given."""
    params = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    fn = {"name": PROBE_NAME, "description": "A probe.", "parameters": params}
    probe = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(probe, tools=[{"type": "function", "function": fn}])
    except ExpresslaneError:
        return False
    return PROBE_NAME in text


def tools_prompt(tools: list[dict], markup: CallMarkup) -> str:
    """The system message text describing `tools` (in template form) and how to call them."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    call = f'{{"name": <function-name>, "{markup.args_key}": <arguments-json-object>}}'
    return TOOLS_PROMPT.format(tools=lines, call=markup.write([call]))


def call_markup(calls: list[dict], markup: CallMarkup) -> str:
    """Template tool calls ({"function": {"name", "arguments"}}) as the model writes them."""
    bodies = []
    for c in calls:
        fn = c["function"]
        body = {"name": fn["name"], markup.args_key: fn["arguments"]}
        bodies.append(json.dumps(body, ensure_ascii=False))
    return markup.write(bodies)


def inline_tools(messages: list[dict], tools: list[dict] | None, markup: CallMarkup) -> list[dict]:
    """`messages` for a template without tools: the tools in the system message, calls as
    the markup, results (consecutive ones together) as a user turn."""
    out: list[dict] = []
    results: dict | None = None  # the user turn holding the latest run of tool results
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results is None:
                results = {"role": "user", "content": text}
                out.append(results)
            else:
                results["content"] += "\n" + text
            continue
        results = None
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = call_markup(m["tool_calls"], markup)
            m = {"role": "assistant", "content": "\n".join(filter(None, [m["content"], calls]))}
        out.append(m)
    return _with_system(out, tools_prompt(tools, markup)) if tools else out


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        merged = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": merged}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class ToolPromptTokenizer:
    """The model's tokenizer, whose `apply_chat_template` puts tools into the prompt itself
    when the template cannot (`inline_tools`); everything else is the tokenizer's."""

    def __init__(self, tokenizer, markup: CallMarkup):
        self._tokenizer = tokenizer
        self._markup = markup
        self.renders_tools = renders_tools(tokenizer)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **kw):
        if not self.renders_tools:
            messages, tools = inline_tools(messages, tools, self._markup), None
        return self._tokenizer.apply_chat_template(messages, tools=tools, **kw)
