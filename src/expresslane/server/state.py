"""What every route needs: the engine, settings, store, metrics, tool and reasoning parsers,
live jobs."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from expresslane.engine.protocol import ServingEngine
from expresslane.server.accounts import Accounts, Ticket
from expresslane.server.errors import not_found
from expresslane.server.keys import ApiKey
from expresslane.server.limits import check_chars, check_count, text_size
from expresslane.server.metrics import ServerMetrics
from expresslane.server.reasoning import ReasoningParser
from expresslane.server.sealing import Sealer
from expresslane.server.settings import ServerSettings
from expresslane.server.store import ResponseStore
from expresslane.server.tool_parsers import ToolParser
from expresslane.server.tool_prompt import ToolPromptTokenizer

# Admission predicts a lane's room before the prompt is tokenized: from its characters, at
# about this many per token (English text and code with BPE vocabularies).
CHARS_PER_TOKEN = 4


@dataclass
class ServerState:
    engine: ServingEngine  # AsyncEngine in one process, FleetEngine in a fleet's ingress
    settings: ServerSettings
    store: ResponseStore
    metrics: ServerMetrics
    model_name: str
    tool_parser: ToolParser
    accounts: Accounts
    model_aliases: set[str] = field(default_factory=set)
    reasoning_parser: ReasoningParser = field(default_factory=ReasoningParser)
    sealer: Sealer | None = None  # seals what clients send back unchanged (sealing.py)
    jobs: dict = field(default_factory=dict)  # response id -> ResponseJob (in flight/recent)
    created: int = field(default_factory=lambda: int(time.time()))

    @functools.cached_property
    def tokenizer(self) -> ToolPromptTokenizer | None:
        """The model's tokenizer; its chat template is given the tools even when the model's
        own cannot render them (`tool_prompt.py`)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return None
        return ToolPromptTokenizer(tokenizer, self.tool_parser.markup)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def grammar_literal(self, text: str) -> str:
        """`text` as a grammar literal for this model's tokenizer (engine/grammar.py)."""
        return self.engine.grammar_literal(text)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """The most characters of prompt text a request may carry (see `limits.py`)."""
        if self.settings.max_prompt_chars is not None:
            return self.settings.max_prompt_chars
        tokenizer, context = self.tokenizer, self.max_model_len
        if tokenizer is None or context is None:
            return None
        return context * tokenizer.longest_token_chars()

    def check_size(
        self, *, items: int, tools: int, text: Any, param: str, truncate: bool = False
    ) -> int:
        """400 for a request over the size limits, before any work; returns its characters.
        A request that may be truncated (`truncation.py`) is held to the character bound
        only for what it keeps."""
        check_count(items, self.settings.max_input_items, param, "items")
        check_count(tools, self.settings.max_tools, "tools", "tools")
        chars = text_size(text)
        if not truncate:
            check_chars(chars, self.max_prompt_chars, param)
        return chars

    def check_model(self, model: str | None) -> str:
        """The served model's id; 404 for a model this server does not serve."""
        if model is None or model == self.model_name or model in self.model_aliases:
            return self.model_name
        raise not_found(
            f"The model '{model}' does not exist on this server; it serves "
            f"'{self.model_name}' (see GET /v1/models).",
            param="model",
            code="model_not_found",
        )

    def admit(
        self, key: ApiKey, service_tier: str | None, prompt_chars: int = 0, generations: int = 1
    ) -> Ticket:
        """The ticket of a request of this key (HTTP or WebSocket; `admission.py`) for
        `generations` engine requests: the lane that serves it, which the engine must be able
        to place in the key's regions. Whether a lane has room is predicted for a prompt of
        about `prompt_chars` characters."""
        tokens = prompt_chars // CHARS_PER_TOKEN + 1

        def room(lane: str) -> bool:
            return self.engine.lane_room(lane, tokens)

        accounts = self.accounts
        ticket = accounts.admit(key, service_tier, self.engine.lane_load, room, generations)
        ticket.promise = self.engine.promises().get(ticket.lane)
        try:
            self.engine.check_placement(ticket.lane, ticket.regions)
        except BaseException:
            accounts.release(ticket)
            raise
        return ticket


def get_state(request: Request) -> ServerState:
    return request.app.state.server
