"""Request bodies (pydantic, strict types, unknown fields rejected with 400).

Input items and chat messages stay loosely typed here (`dict`); `prompt.py` checks them one by
one so an error can name the exact field (`input[2].call_id`).
Engine extensions (vLLM-style) are accepted on every endpoint: `top_k`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `repetition_penalty`, `min_p`, and
`seed`/`stop` on Responses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from expresslane.lanes import TierName
from expresslane.server.errors import invalid

# OpenAI's values (the SDK's `ReasoningEffort`); gpt-oss's template writes it into its header
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
REASONING_EFFORTS: tuple[str, ...] = ReasoningEffort.__args__


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EngineExtras(Strict):
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    # isolates this request's prefix-cache entries: only requests with the same salt (and, with
    # API keys, the same owner) share cached prefixes (vLLM's name)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


def _check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    if v is None:
        return v
    if len(v) > 16:
        raise ValueError("metadata holds at most 16 key-value pairs")
    for key, value in v.items():
        if len(key) > 64 or len(value) > 512:
            raise ValueError("metadata keys are at most 64 characters, values at most 512")
    return v


# -- Responses ------------------------------------------------------------------------------

_TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"
# What `include` may ask for (OpenAI's `ResponseIncludable`); the ones about hosted tools and
# images have nothing to add here
Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


Callers = list[Literal["direct", "programmatic"]] | None


class FunctionTool(Strict):
    """A Responses function tool (flat: name, parameters at the top level)."""

    type: Literal["function"]
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    allowed_callers: Callers = None  # accepted; every call here is direct
    defer_loading: bool | None = None  # accepted; every tool is offered at once
    output_schema: dict[str, Any] | None = None


class CustomToolFormat(Strict):
    """A custom tool's input: free text, or text of a grammar (Lark or a regular expression)."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(Strict):
    """A Responses custom (freeform) tool: its input is text, not JSON arguments."""

    type: Literal["custom"]
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    format: CustomToolFormat | None = None
    allowed_callers: Callers = None
    defer_loading: bool | None = None


class NamespaceTool(Strict):
    """Function and custom tools grouped under a namespace (calls name both)."""

    type: Literal["namespace"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]]


# Tools OpenAI runs itself (or the client runs on the model's typed calls): accepted, never
# offered to the model here, and named in the response's `tools_not_offered`.
HOSTED_TOOLS = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer",
    "computer_use_preview",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "tool_search",
    "programmatic_tool_calling",
)


class HostedTool(BaseModel):
    """A hosted tool: its settings are OpenAI's and are kept as sent."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]


ResponsesTool = Annotated[
    FunctionTool | CustomTool | NamespaceTool | HostedTool, Field(discriminator="type")
]


class ToolChoiceFunction(Strict):
    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None


class ToolChoiceHosted(BaseModel):
    """A hosted tool as the tool choice: no such tool runs here, so the model answers."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]


_FORMAT_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class TextFormat(Strict):
    """Responses `text.format`: text, any JSON object, or JSON of a schema (flat fields)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=_FORMAT_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseCreateRequest(EngineExtras):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    background: bool | None = False
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ResponsesTool] | None = None
    tool_choice: (
        Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceHosted | None
    ) = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    service_tier: TierName | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig | None = None
    include: list[Includable] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    client_metadata: dict[str, str] | None = None  # Codex's; accepted, not stored
    context_management: Any = None  # accepted, ignored
    moderation: Any = None  # accepted, ignored
    prompt_cache_options: Any = None  # accepted, ignored
    seed: int | None = None
    stop: str | list[str] | None = None

    _check_metadata = field_validator("metadata")(_check_metadata)


class WsResponseCreate(ResponseCreateRequest):
    """A WebSocket-mode `response.create` message: the create body plus transport fields."""

    type: Literal["response.create"]
    stream_id: str | None = None
    generate: bool | None = True
    event_id: str | None = None


class InputTokensRequest(ResponseCreateRequest):
    """POST /v1/responses/input_tokens: the create body (fields that only steer generation
    are accepted and ignored; `max_output_tokens` sets the room truncation=auto leaves)."""

    conversation: str | dict[str, Any] | None = None  # accepted; not supported (400)
    personality: str | None = Field(None, max_length=64)  # accepted, ignored


# -- Chat Completions -------------------------------------------------------------------------


class ChatFunction(Strict):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: ChatFunction


class NamedFunction(Strict):
    name: str


class ChatToolChoiceFunction(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(pattern=_FORMAT_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """Chat `response_format`: text, any JSON object, or JSON of `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(EngineExtras):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    service_tier: TierName | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    client_metadata: dict[str, str] | None = None  # Codex's; accepted, not stored
    reasoning_effort: ReasoningEffort | None = None  # the chat template's `reasoning_effort`
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None

    _check_metadata = field_validator("metadata")(_check_metadata)


# -- Completions ----------------------------------------------------------------------------


class CompletionRequest(EngineExtras):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    stop: str | list[str] | None = None
    seed: int | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    service_tier: TierName | None = None
    user: str | None = None


def check_unsupported(body) -> None:
    """Fields the API defines but this server cannot honour yet, or not in this combination:
    a clear 400."""
    if body.stream_options is not None and not body.stream:
        raise invalid(
            "'stream_options' is only allowed when 'stream' is true.",
            param="stream_options",
            code="invalid_value",
        )
