"""One chat completion choice as its outputs arrive: reasoning (split off by the model's
reasoning parser), visible text (tool-call markup held back and parsed at the end), tool
calls, logprobs; and the usage object for a set of choices."""

from __future__ import annotations

from expresslane.engine.output import RequestOutput
from expresslane.server.errors import generation_error
from expresslane.server.logprobs import chat_logprobs
from expresslane.server.reasoning import ReasoningParser, Split, reasoning_tokens
from expresslane.server.tool_parsers import ToolCall, ToolParser


class Choice:
    """One choice's text, tool calls and logprobs as its outputs arrive."""

    def __init__(
        self,
        index: int,
        parser: ToolParser | None,
        declared: set[str],
        tokenizer,
        logprobs: bool,
        parallel: bool,
        reasoning: ReasoningParser,
    ):
        self.index = index
        self.splitter = reasoning.streamer()
        self.reasoning = ""
        self.streamer = parser.streamer(declared) if parser is not None else None
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs
        self.parallel = parallel
        self.text = ""
        self.calls: list[ToolCall] = []
        self.logprobs: list[dict] = []
        self.pending: list[dict] = []
        self.final: RequestOutput | None = None

    def add(self, out: RequestOutput) -> Split:
        """The reasoning and visible text this output adds."""
        if self.want_logprobs and out.new_logprobs:
            lps = chat_logprobs(self.tokenizer, out.new_token_ids, out.new_logprobs)
            self.logprobs += lps
            self.pending += lps
        if out.finished:
            self.final = out
        return self._take(self.splitter.feed(out.new_text))

    def _take(self, split: Split) -> Split:
        text = self.streamer.feed(split.content) if self.streamer else split.content
        self.text += text
        self.reasoning += split.reasoning
        return Split(split.reasoning, text)

    def finish(self) -> Split:
        """The rest of the reasoning and text; the tool calls are parsed."""
        split = self._take(self.splitter.finish())
        if self.streamer is not None:
            tail, calls = self.streamer.finish()
            self.calls = calls if self.parallel else calls[:1]
            self.text += tail
            split.content += tail
        return split

    def take_logprobs(self) -> dict | None:
        if not self.want_logprobs:
            return None
        lps, self.pending = self.pending, []
        return {"content": lps, "refusal": None}

    @property
    def finish_reason(self) -> str:
        if self.calls:
            return "tool_calls"
        return "length" if self.final and self.final.finish_reason == "length" else "stop"

    def tool_calls(self) -> list[dict]:
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls
        ]


def chat_usage(choices: list[Choice]) -> dict:
    first = choices[0].final
    n_in = first.num_prompt_tokens if first else 0
    n_out = sum(c.final.num_output_tokens for c in choices if c.final)
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_details": {
            "cached_tokens": first.num_cached_tokens if first else 0,
            "audio_tokens": 0,
        },
        "completion_tokens_details": {
            "reasoning_tokens": sum(reasoning_tokens(c.tokenizer, c.reasoning) for c in choices),
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def check_finished(out: RequestOutput) -> None:
    if out.finished and out.finish_reason in ("error", "abort"):
        raise generation_error(out.error)
