"""`ServingEngine`: all the server needs of an engine. `AsyncEngine` is one (the model in this
process); `fleet.remote_engine.FleetEngine` is another (replicas on a Ray cluster)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from expresslane.engine.output import RequestOutput
from expresslane.engine.snapshot import EngineSnapshot
from expresslane.engine.submission import Submission
from expresslane.lanes import Lane
from expresslane.promise import Stated
from expresslane.sampling_params import SamplingParams
from expresslane.tokenizer import Tokenizer


class PreparedRequest(Protocol):
    """What the server may read of a request `make_request` made, to hand to `enqueue` (the
    engine's `Request` is one; nothing outside the engine changes it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def lane(self) -> str: ...
    @property
    def params(self) -> SamplingParams:
        """Its sampling parameters as validated (`engine/admission.py`)."""

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int:
        """Generated so far, where this process runs it (0 where another does)."""


class OutputStream(Protocol):
    """A started request's outputs, one per engine step that changed it."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...
    def watch(self, callback: Callable[[RequestOutput], None]) -> None:
        """Call `callback` with each output as it arrives, before (and whether) it is read."""


class ServingEngine(Protocol):
    ready: threading.Event  # set once the engine takes work

    @property
    def tokenizer(self) -> Tokenizer | None: ...
    @property
    def model_path(self) -> str | None: ...
    @property
    def lanes(self) -> dict[str, Lane]: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def sampling_defaults(self) -> dict:
        """SamplingParams fields from the model's generation config, for requests that do not
        set them (`request_factory.SAMPLING_DEFAULTS`)."""

    def make_request(self, sub: Submission) -> PreparedRequest:
        """Validate and tokenize (raises InvalidRequestError; `RequestFactory.make`)."""

    def check_placement(self, lane: str, regions: list[str] | None) -> None:
        """Raise (an APIError) when the lane cannot be served in any of the regions."""

    def enqueue(self, req: PreparedRequest, regions: list[str] | None = None) -> OutputStream:
        """Start a request made by `make_request` in one of the regions (None: any); must be
        called from the event loop."""

    def abort(self, request_id: str) -> None: ...
    def lane_load(self, lane: str) -> int:
        """Requests of this lane submitted and not finished yet (a `lanes.LaneCounts`)."""

    def lane_room(self, lane: str, prompt_tokens: int) -> bool:
        """Whether the lane can take one more request (of a prompt of about `prompt_tokens`)
        now: below its max batch and, for a lane with a promise, keeping it for all
        (`engine/lane_room.py`)."""

    def promises(self) -> dict[str, Stated]:
        """Each lane's promise as stated (published, and checked per request); a lane whose
        "auto" promise is not measured yet has none."""

    def is_alive(self) -> bool: ...
    def grammar_literal(self, text: str) -> str: ...
    def snapshot(self) -> EngineSnapshot: ...
    def shutdown(self, timeout: float = 5.0) -> None: ...
