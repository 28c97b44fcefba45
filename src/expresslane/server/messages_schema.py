"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`).

Strict as Anthropic's own API is (unknown fields are a 400). Message content blocks stay
loosely typed (`dict`): `messages_prompt.py` reads them one by one, so that an error names
the exact block (`messages[2].content[1].tool_use_id`). `cache_control` is accepted wherever
Anthropic takes it and ignored: the prefix cache works on every request without breakpoints.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from expresslane.lanes import TierName


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class Tool(Strict):
    """A client tool: a name, a description and the JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: str | None = None


class ThinkingOther(Strict):
    """`disabled`, and `adaptive` (the model decides: the model's own default here)."""

    type: Literal["disabled", "adaptive"]
    display: str | None = None


Thinking = Annotated[ThinkingEnabled | ThinkingOther, Field(discriminator="type")]


class Metadata(Strict):
    user_id: str | None = Field(None, max_length=256)


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


Speed = Literal["standard", "fast"]
# Anthropic's own values, and this server's tiers for clients that name them
ServiceTier = Literal["standard_only"] | TierName


class CountTokensRequest(Strict):
    """What the prompt is made of: the fields `count_tokens` shares with a create request."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    speed: Speed | None = None
    cache_control: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: ServiceTier | None = None
    # accepted so that clients sending them work; nothing here acts on them
    container: Any = None
    context_management: Any = None
    inference_geo: str | None = None
    mcp_servers: Any = None


class MessagesJob(BaseModel):
    """A Messages request as admission sees it (`admission.admit_and_submit`): the body, the
    tier its `speed` asks for, and the sampling fields every endpoint names alike
    (`generation.SHARED_SAMPLING_FIELDS`), which the model's defaults may fill."""

    request: MessagesRequest
    model: str | None
    service_tier: str | None
    cache_salt: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
