"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP.

`/tokenize` takes a `prompt` (encoded as /v1/completions would, `add_special_tokens` true by
default) or chat `messages` (rendered with the chat template as /v1/chat/completions would, with
`add_generation_prompt`, `continue_final_message` and `tools`, the messages' special-token
text kept text as there); it answers `{count, max_model_len, tokens}`, plus `token_strs` (the
vocabulary pieces) when `return_token_strs` is true. `/detokenize` decodes `tokens` back to
`{prompt}`, special tokens kept, and refuses ids outside the vocabulary. The paths sit outside
/v1, so the routes check API keys themselves.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Discriminator, Field, Tag

from expresslane.server.body import StrictJSONRoute
from expresslane.server.errors import invalid
from expresslane.server.limits import check_count, off_loop, text_size
from expresslane.server.prompt import chat_messages, render_marked, template_tools
from expresslane.server.schemas import ChatTool, Strict
from expresslane.server.state import ServerState, get_state
from expresslane.user_text import ChatPrompt


async def _authenticate(request: Request) -> None:
    get_state(request).accounts.authenticate(request.headers.get("authorization"))


router = APIRouter(route_class=StrictJSONRoute, dependencies=[Depends(_authenticate)])


class TokenizePrompt(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(Strict):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[ChatTool] | None = None


def _body_kind(value: Any) -> str:
    return "Chat" if isinstance(value, dict) and "messages" in value else "Prompt"


TokenizeBody = Annotated[
    Annotated[TokenizePrompt, Tag("Prompt")] | Annotated[TokenizeChat, Tag("Chat")],
    Discriminator(_body_kind),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenizer(state: ServerState, param: str):
    if state.tokenizer is None:
        raise invalid("This model has no tokenizer; only token ids can be sent.", param=param)
    return state.tokenizer


def _chat_prompt(tokenizer, body: TokenizeChat) -> ChatPrompt:
    """The chat template's text for the messages (cut after the last message's content when
    continuing it, as Hugging Face's `continue_final_message` does), client strings kept text
    as on the chat endpoints."""
    generation_prompt = body.add_generation_prompt
    if body.continue_final_message:
        if "add_generation_prompt" in body.model_fields_set and generation_prompt:
            raise invalid(
                "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
                param="continue_final_message",
            )
        generation_prompt = False
    messages = chat_messages(body.messages)
    tools = template_tools([t.function.model_dump() for t in body.tools or []])
    text = render_marked(
        tokenizer, messages, tools, "messages", add_generation_prompt=generation_prompt
    )
    final = tokenizer.special_texts.mark(messages[-1]["content"])
    if body.continue_final_message and final:
        end = text.rfind(final)
        if end < 0:  # some templates strip the content they render
            final = final.strip()
            end = text.rfind(final)
        if end >= 0:
            text = text[: end + len(final)]
    return ChatPrompt.from_marked(text)


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(body: TokenizeBody, request: Request):
    state = get_state(request)
    state.check_model(body.model)
    if isinstance(body, TokenizeChat):
        check_count(len(body.messages), state.settings.max_input_items, "messages", "items")
        check_count(len(body.tools or []), state.settings.max_tools, "tools", "tools")
        param, chars = "messages", text_size(body.messages)
    else:
        param, chars = "prompt", len(body.prompt)
    tokenizer = _tokenizer(state, param)

    def encode() -> list[int]:
        text = body.prompt if isinstance(body, TokenizePrompt) else _chat_prompt(tokenizer, body)
        return tokenizer.encode(text, body.add_special_tokens)

    ids = await off_loop(encode, chars)
    strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request):
    state = get_state(request)
    state.check_model(body.model)
    tokenizer = _tokenizer(state, "tokens")
    vocab = tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise invalid(
                f"Token id {token} is out of vocabulary: ids are in [0, {vocab}).",
                param=f"tokens[{i}]",
                code="invalid_value",
            )
    text = await off_loop(lambda: tokenizer.decode(body.tokens, False), len(body.tokens))
    return DetokenizeResponse(prompt=text)
