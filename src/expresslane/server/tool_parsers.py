"""Tool-call parsers: turn a model's assistant text into plain content plus function calls.

Each model family writes calls in its own markup; a parser knows one format:

- `hermes` (the default; Hermes / Qwen2.5, and the demo model's chat template):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, anywhere in the text.
- `llama3_json` (Llama 3.1/3.2): the whole message is `{"name": "f", "parameters": {...}}`,
  optionally after `<|python_tag|>`; several calls are separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` or, in newer
  tokenizers, `[TOOL_CALLS]f[ARGS]{...}` repeated.
- `harmony` (gpt-oss): a message to `functions.f` in the commentary channel, its body the
  arguments; `harmony.py` passes it on as `<|channel|>commentary to=functions.f
  <|constrain|>json<|message|>{...}<|call|>`.

Streaming goes through `ToolCallStreamer`: text is passed on as it arrives until the start of
tool-call markup, which is buffered to the end and parsed then, so markup never leaks into the
visible text. Trailing whitespace is held back so the content before a call comes out stripped.
Markers are read on the text as detokenized, where text that only spells a special token is told
apart from it (`spelled.py`); the text passed on is unspelled.
Malformed markup (bad JSON, a missing name, a truncated call) falls back to plain text.
`ToolParser.parse(text)` runs the same streamer over the whole text, so a streamed result always
equals the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from expresslane.server.grammars import CallMarkup
from expresslane.server.harmony import CALL_END, CALL_MARK, CALL_OPEN, CALL_START
from expresslane.spelled import unspell


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]


def _make_call(obj, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a decoded JSON object, or None if it is not a well-formed call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name.strip(), arguments=json.dumps(args, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolParser:
    """Base class. `start_markers` begin tool-call markup; with `anchored`, markup counts only
    at the start of the message (after whitespace)."""

    name = "base"
    start_markers: tuple[str, ...] = ()
    anchored = False
    # True when the markers are special tokens that must not be skipped while detokenizing.
    needs_special_tokens = False
    markup = CallMarkup()  # how calls are written, for the grammar that constrains them

    def parse_calls(self, region: str) -> list[ToolCall] | None:
        """Parse markup that starts with a start marker; None when it is malformed."""
        raise NotImplementedError

    def as_text(self, region: str) -> str:
        """Markup that was not a call, as the text passed on."""
        return region

    def streamer(self, declared: set[str] | None = None) -> ToolCallStreamer:
        return ToolCallStreamer(self, declared)

    def parse(self, text: str, declared: set[str] | None = None) -> ParsedOutput:
        s = self.streamer(declared)
        head = s.feed(text)
        tail, calls = s.finish()
        return ParsedOutput(head + tail, calls)


class HermesToolParser(ToolParser):
    name = "hermes"
    markup = CallMarkup(
        "<tool_call>", item_open="<tool_call>\n", item_close="\n</tool_call>", sep="\n"
    )
    start_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse_calls(self, region: str) -> list[ToolCall] | None:
        calls = []
        for body in self._block.findall(region):
            call = _make_call(_loads(body.strip()))
            if call is None:
                return None
            calls.append(call)
        return calls or None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markup = CallMarkup(sep="; ", args_key="parameters", anchored=True)
    start_markers = ("<|python_tag|>", "{")
    anchored = True
    needs_special_tokens = True

    def parse_calls(self, region: str) -> list[ToolCall] | None:
        text = region.removeprefix("<|python_tag|>").strip()
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(text):
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return None
            call = _make_call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            pos = end
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
        return calls or None


class MistralToolParser(ToolParser):
    name = "mistral"
    markup = CallMarkup("[TOOL_CALLS]", open="[TOOL_CALLS][", sep=", ", close="]")
    start_markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True

    def parse_calls(self, region: str) -> list[ToolCall] | None:
        body = region[len("[TOOL_CALLS]") :].strip()
        if body.startswith("["):  # [TOOL_CALLS][{...}, {...}]
            try:
                obj, _ = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError:
                return None
            if not isinstance(obj, list):
                return None
            calls = [_make_call(o) for o in obj]
            return None if not calls or None in calls else calls
        calls = []  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
        for chunk in region.split("[TOOL_CALLS]")[1:]:
            name, sep, args = chunk.partition("[ARGS]")
            call = _make_call({"name": name, "arguments": _loads(args.strip())}) if sep else None
            if call is None:
                return None
            calls.append(call)
        return calls or None


class HarmonyToolParser(ToolParser):
    """Reads the call markup `harmony.py` passes on (its calls between CALL_MARKs)."""

    name = "harmony"
    markup = CallMarkup(CALL_OPEN)  # calls have no JSON body: `harmony_grammar.py`
    start_markers = (CALL_START,)
    needs_special_tokens = True
    _block = re.compile(
        re.escape(CALL_START) + r"([^\s<]+)[^<]*(?:<\|constrain\|>\S*?)?<\|message\|>(.*?)"
        rf"(?:{re.escape(CALL_END)}|\Z)",
        re.DOTALL,
    )

    def as_text(self, region: str) -> str:
        return region.replace(CALL_MARK, "")

    def parse_calls(self, region: str) -> list[ToolCall] | None:
        calls = []
        for name, body in self._block.findall(region):
            call = _make_call({"name": name, "arguments": _loads(body.strip())})
            if call is None:
                return None
            calls.append(call)
        return calls or None


class ToolCallStreamer:
    """Feed text deltas; get back the text that is safe to show now. `finish()` returns the
    rest of the text and the parsed calls."""

    def __init__(self, parser: ToolParser, declared: set[str] | None = None):
        self.parser = parser
        self.declared = declared  # calls to other names are plain text (None: any name)
        self.pending = ""  # text not passed on yet (whitespace or a possible marker start)
        self.region: str | None = None  # tool-call markup, from its start marker on
        self.dropped = ""  # whitespace between the content and the markup
        self.started = False  # some non-whitespace text has been seen

    def feed(self, delta: str) -> str:
        return unspell(self._feed(delta))

    def _feed(self, delta: str) -> str:
        if self.region is not None:
            self.region += delta
            return ""
        self.pending += delta
        if self.parser.anchored:
            return self._feed_anchored()
        starts = [(i, m) for m in self.parser.start_markers if (i := self.pending.find(m)) != -1]
        if starts:
            idx = min(starts)[0]
            head = self.pending[:idx]
            out = head.rstrip()
            self.dropped = head[len(out) :]
            self.region, self.pending = self.pending[idx:], ""
            return out
        keep = self._partial_marker_len()
        emit_upto = len(self.pending) - keep
        stripped = self.pending[:emit_upto].rstrip()
        out, self.pending = stripped, self.pending[len(stripped) :]
        return out

    def _feed_anchored(self) -> str:
        if self.started:
            out, self.pending = self.pending, ""
            return out
        text = self.pending.lstrip()
        if not text:
            return ""
        for m in self.parser.start_markers:
            if text.startswith(m):
                self.dropped = self.pending[: len(self.pending) - len(text)]
                self.region, self.pending = text, ""
                return ""
            if m.startswith(text):
                return ""  # could still become a marker
        self.started = True
        out, self.pending = self.pending, ""
        return out

    def _partial_marker_len(self) -> int:
        best = 0
        for m in self.parser.start_markers:
            for n in range(min(len(m) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(m[:n]):
                    best = max(best, n)
                    break
        return best

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, calls = self._finish()
        return unspell(text), calls

    def _finish(self) -> tuple[str, list[ToolCall]]:
        if self.region is None:
            out, self.pending = self.pending, ""
            return out, []
        calls = self.parser.parse_calls(self.region)
        if calls is not None and self.declared is not None:
            calls = None if any(c.name not in self.declared for c in calls) else calls
        if calls is None:  # malformed or undeclared: it was plain text after all
            return self.dropped + self.parser.as_text(self.region), []
        return "", calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "harmony": HarmonyToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None


def detect_tool_parser(chat_template: str | None) -> ToolParser:
    """Pick the parser that matches a chat template's tool-call format (default: hermes)."""
    t = chat_template or ""
    if "<|channel|>" in t:
        return HarmonyToolParser()
    if "[TOOL_CALLS]" in t:
        return MistralToolParser()
    if "<tool_call>" not in t and ("<|python_tag|>" in t or "ipython" in t):
        return Llama3JsonToolParser()
    return HermesToolParser()
