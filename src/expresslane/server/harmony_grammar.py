"""The grammar of a gpt-oss answer in harmony (`harmony.py`): an optional analysis message,
then the final answer or one call to a declared function (a call ends the turn with
`<|call|>`, an end token, so harmony has one call per turn and `parallel_tool_calls` changes
nothing). The arguments follow the function's parameters; the answer, when `content` is
given, its JSON schema. The end tokens (`<|return|>`, `<|call|>`) are the model's EOS, which
the matcher allows once the grammar is complete.
"""

from __future__ import annotations

from expresslane.sampling_params import Grammar
from expresslane.server.grammars import ANY, Literal, _declared_only, _json
from expresslane.server.harmony import CALL_OPEN, MESSAGE

ANALYSIS = f"<|channel|>analysis{MESSAGE}"
NEXT = "<|end|><|start|>assistant"
FINAL = f"<|channel|>final{MESSAGE}"


def harmony_grammar(
    tools: list[dict],
    choice: str | dict,
    literal: Literal,
    content: dict | None,
    content_param: str = "response_format",
) -> Grammar | None:
    """`choice` as in `grammars.tool_calls`; None when nothing needs constraining. Errors in
    the output format's schema name `content_param`."""
    forced = isinstance(choice, dict) or choice == "required"
    if isinstance(choice, dict):
        tools = [t for t in tools if t["name"] == choice["name"]]
    calls = bool(tools) and choice != "none"
    if not calls and content is None and not tools:
        return None
    answer = ("call" if forced else "final | call") if calls else "final"
    text = _json(content) if content is not None else "TEXT"
    rules = [
        "%llguidance {}",
        f"start: analysis? ({answer})",
        f"analysis: {literal(ANALYSIS)} TEXT {literal(NEXT)}",
        f"final: {literal(FINAL)} {text}",
        f"TEXT: /{ANY}/",
    ]
    if calls:
        names = [f"call_{i}" for i in range(len(tools))]
        rules.append(f"call: {' | '.join(names)}")
        rules += [_call_rule(n, t, literal) for n, t in zip(names, tools, strict=True)]
    param = "tools" if calls else (content_param if content is not None else "tool_choice")
    return Grammar("\n".join(rules) + "\n", param)


def _call_rule(rule: str, tool: dict, literal: Literal) -> str:
    head = f"{CALL_OPEN}{tool['name']} <|constrain|>json{MESSAGE}"
    params = _declared_only(tool.get("parameters") or {"type": "object"})
    return f"{rule}: {literal(head)} {_json(params)}"
