"""Tokenizer (Hugging Face `tokenizers`), chat template rendering (jinja2, as transformers
does it) and incremental detokenization for streaming.

A rendered chat prompt (`user_text.ChatPrompt`) encodes its client-written special-token text
as text (`_encode_chat`); streamed text that keeps special tokens spells them apart from text
that only looks like one (`spelled.py`)."""

from __future__ import annotations

import bisect
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from expresslane.errors import InvalidRequestError, ModelLoadError
from expresslane.spelled import SpelledStream, openers
from expresslane.user_text import ChatPrompt, SpecialTexts


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _named_templates(template: str | list | dict | None) -> dict[str, str]:
    """{name: source}: a single template is "default"; a list of {"name", "template"} (or a
    dict) names each, and the first stands in for a missing "default"."""
    if not template:
        return {}
    if isinstance(template, str):
        return {"default": template}
    named = template if isinstance(template, dict) else {t["name"]: t["template"] for t in template}
    return {"default": next(iter(named.values())), **named}


def chat_template_files(path: Path) -> str | dict | None:
    """The chat template(s) in the files beside the tokenizer, or None."""
    jinja = path / "chat_template.jinja"
    extra = path / "additional_chat_templates"
    named = {f.stem: f.read_text() for f in sorted(extra.glob("*.jinja"))} if extra.is_dir() else {}
    if jinja.is_file():
        return {"default": jinja.read_text(), **named} if named else jinja.read_text()
    js = path / "chat_template.json"
    if js.is_file():
        template = json.loads(js.read_text()).get("chat_template")
        return {**_named_templates(template), **named} if named else template
    return named or None


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict):
        self._tok = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        sources = _named_templates(config.get("chat_template"))
        self._templates = {name: _environment().from_string(t) for name, t in sources.items()}
        # the template tools are rendered with: "tool_use" where the model has one
        self.chat_template_source = sources.get("tool_use", sources.get("default"))
        self._texts: dict[int, str] = {}  # token id -> its text alone (logprobs name each token)
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._openers = openers(added[i].content for i in self.special_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """`tokenizer.json`, `tokenizer_config.json`, and the chat template from
        `chat_template.jinja` (and `additional_chat_templates/*.jinja`, named) or
        `chat_template.json` where present, as transformers saves them; else the config's."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = chat_template_files(path)
        if template:
            config["chat_template"] = template
        return cls(HFTokenizer.from_file(str(file)), config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def longest_token_chars(self) -> int:
        """The most characters one token decodes to (bounds the tokens a text needs)."""
        return max((len(piece) for piece in self._tok.get_vocab()), default=1) or 1

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if isinstance(text, ChatPrompt) and text.marks:
            return self._encode_chat(text, add_special_tokens)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def special_texts(self) -> SpecialTexts:
        """The special tokens' texts, to mark in client strings (`user_text.py`)."""
        added = self._tok.get_added_tokens_decoder()
        return SpecialTexts(added[i].content for i in self.special_ids)

    @cached_property
    def _plain(self) -> HFTokenizer:
        """The tokenizer encoding special tokens' texts as text."""
        plain = HFTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    def _encode_chat(self, prompt: ChatPrompt, add_special_tokens: bool) -> list[int]:
        """The prompt's special tokens but those spanning a mark (client-written), and the text
        between them encoded with no special token at all; as `encode` when there are none."""
        whole = self._tok.encode(prompt, add_special_tokens=False)
        kept = [
            (a, b)
            for i, (a, b) in zip(whole.ids, whole.offsets, strict=True)
            if i in self.special_ids and not _spans_mark(prompt.marks, a, b)
        ]
        if len(kept) == sum(i in self.special_ids for i in whole.ids):
            return self._tok.encode(prompt, add_special_tokens=add_special_tokens).ids
        parts, pos = [], 0
        for a, b in kept:
            parts += [self._plain.encode(prompt[pos:a], add_special_tokens=False)]
            parts += [self._tok.encode(prompt[a:b], add_special_tokens=False)]
            pos = b
        parts.append(self._plain.encode(prompt[pos:], add_special_tokens=False))
        merged = Encoding.merge(parts, growing_offsets=True)
        return self._tok.post_process(merged, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (as logprobs name it); remembered, as
        streamed logprobs ask for every token again."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs,
    ) -> str:
        template = self._templates.get("tool_use") if tools else None
        template = template or self._templates.get("default")
        if template is None:
            raise InvalidRequestError(
                "this model has no chat template (no chat_template.jinja, chat_template.json "
                "or chat_template in tokenizer_config.json); use the completions endpoint "
                "with a plain prompt",
                param="messages",
            )
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(
                f"the chat template rejected these messages: {e}", param="messages"
            ) from e

    def stream(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> SpelledStream:
        """An incremental detokenizer primed with the prompt's tail (for correct spacing)."""
        return SpelledStream(prompt_ids[-4:], skip_special_tokens, self.special_ids, self._openers)

    def step(self, stream: SpelledStream, token_id: int) -> str:
        return stream.step(self._tok, token_id)


def _spans_mark(marks: tuple[int, ...], start: int, end: int) -> bool:
    """Whether a mark lies strictly inside [start, end)."""
    i = bisect.bisect_right(marks, start)
    return i < len(marks) and marks[i] < end
