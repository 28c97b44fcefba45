"""gpt-oss's harmony format, read back from its output: which channel each message is in.

After the prompt's `<|start|>assistant` the model writes messages, each a header up to
`<|message|>` (its channel after `<|channel|>`, a recipient after `to=`, a content type
after `<|constrain|>`), then a body up to `<|end|>`, `<|call|>` or `<|return|>` (the last two
are end tokens, so they never reach the text). The next message starts with `<|start|>` and
its role. `analysis` bodies are reasoning; a message to `functions.NAME` is a tool call,
passed on as content in one fixed markup that `HarmonyToolParser` (`tool_parsers.py`) reads;
everything else (`final`, a `commentary` preamble) is content. Text with no header at all is
content too (a model that does not write harmony loses nothing).

The markers are read on the special tokens, not on text that spells them: the detokenizer
writes a `<|` that ordinary tokens make with a word joiner inside (`spelled.py`), so text a
model writes can neither end its message nor open a call; the text passed on is unspelled. The
call markup passed on opens and closes with CALL_MARK, which no text passed on holds, so the
tool parser finds only calls the model made with special tokens.
"""

from __future__ import annotations

import re

from expresslane.server.reasoning import ReasoningParser, Split
from expresslane.spelled import unspell

MESSAGE = "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
CALL_OPEN = "<|channel|>commentary to=functions."
CALL_CLOSE = "<|call|>"
CALL_MARK = "\ufdd1"  # a Unicode noncharacter: taken out of all text passed on
CALL_START = CALL_MARK + CALL_OPEN
CALL_END = CALL_MARK + CALL_CLOSE
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")


def call_markup(name: str, arguments: str) -> str:
    """A call as the harmony tool parser reads it (the header as the grammar makes gpt-oss
    write it, between CALL_MARKs)."""
    return f"{CALL_START}{name} <|constrain|>json{MESSAGE}{arguments}{CALL_END}"


def passed_on(text: str) -> str:
    """Body text as passed on: unspelled, with no CALL_MARK."""
    return unspell(text).replace(CALL_MARK, "")


class HarmonyReasoningParser(ReasoningParser):
    name = "harmony"
    needs_special_tokens = True

    def streamer(self) -> HarmonyStreamer:
        return HarmonyStreamer()


class HarmonyStreamer:
    """Feed output text as it arrives; get back the reasoning and content safe to pass on."""

    def __init__(self):
        self.buffer = ""  # text not yet routed: a header, or a body's possible end marker
        self.in_body = False
        self.route = "content"  # where the current body goes: reasoning, content or call

    def feed(self, delta: str) -> Split:
        self.buffer += delta
        out = Split()
        while True:
            step = self._body() if self.in_body else self._header()
            if step is None:
                return out
            out += step

    def finish(self) -> Split:
        text, self.buffer = self.buffer, ""
        if self.in_body:
            return self._emit(text) + self._close()
        if "<|channel|>" in text or MESSAGE in text:
            return Split()  # a header cut short: nothing of it is the answer
        return Split(content=passed_on(text.removeprefix("<|start|>assistant")))

    def _header(self) -> Split | None:
        """Reads a complete header, starting its body; None while it is incomplete."""
        idx = self.buffer.find(MESSAGE)
        if idx == -1:
            return None
        header, self.buffer = self.buffer[:idx], self.buffer[idx + len(MESSAGE) :]
        self.in_body = True
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            self.route = "call"
            name = recipient.group(1).removeprefix("functions.")
            return Split(content=f"{CALL_START}{name} <|constrain|>json{MESSAGE}")
        analysis = channel is not None and channel.group(1) == "analysis"
        self.route = "reasoning" if analysis else "content"
        return Split()

    def _body(self) -> Split | None:
        """Passes on the body up to its end marker (then reads the next header), or all of
        it but a possible start of a marker; None when nothing can be passed on."""
        ends = [(i, m) for m in BODY_ENDS if (i := self.buffer.find(m)) != -1]
        if ends:
            idx, marker = min(ends)
            text = self.buffer[:idx]
            skip = idx if marker == "<|start|>" else idx + len(marker)
            self.buffer = self.buffer[skip:]
            self.in_body = False
            return self._emit(text) + self._close()
        cut = len(self.buffer) - _partial_marker(self.buffer)
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return self._emit(text) if text else None

    def _emit(self, text: str) -> Split:
        if self.route == "reasoning":
            return Split(reasoning=passed_on(text))
        return Split(content=passed_on(text))

    def _close(self) -> Split:
        return Split(content=CALL_END) if self.route == "call" else Split()


def _partial_marker(text: str) -> int:
    """The length of the longest end of `text` that could begin a body's end marker."""
    start = text.rfind("<", max(0, len(text) - max(len(m) for m in BODY_ENDS)))
    while start != -1:
        tail = text[start:]
        if any(m.startswith(tail) for m in BODY_ENDS):
            return len(tail)
        start = text.find("<", start + 1)
    return 0
