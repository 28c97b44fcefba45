"""The admission checks that need the model: its vocabulary and context length (the rest are
`SamplingParams`'). A request that passes them cannot make an engine step raise."""

from __future__ import annotations

import dataclasses

from expresslane.errors import ContextLengthExceeded, InvalidRequestError
from expresslane.sampling_params import SamplingParams
from expresslane.tokenizer import Tokenizer


def tokenize(
    tokenizer: Tokenizer | None, vocab: int, prompt: str | list[int], add_special_tokens: bool
) -> tuple[list[int], str | None]:
    """(token ids, prompt text or None); token ids given as the prompt must be in the vocab. A
    rendered chat prompt (`user_text.ChatPrompt`) encodes its clients' special-token text as
    text (`Tokenizer.encode`)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass token ids", param="prompt")
        ids, text = tokenizer.encode(prompt, add_special_tokens), prompt
    else:
        ids, text = list(prompt), None
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", param="prompt")
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return ids, text


def check_params(
    params: SamplingParams, prompt_len: int, max_model_len: int, vocab: int, clamp: bool = False
) -> SamplingParams:
    """`params` for a prompt of `prompt_len` tokens, or an InvalidRequestError. A top_k of at
    least the vocabulary keeps every token: it becomes 0 (no filter). With `clamp`, a
    `max_tokens` past the context is lowered to what fits."""
    room = max_model_len - prompt_len
    if clamp and params.max_tokens is not None and room >= 1 and params.max_tokens > room:
        params = dataclasses.replace(params, max_tokens=room)
    if room < 1:
        raise ContextLengthExceeded(
            f"the prompt has {prompt_len} tokens but this model's context is "
            f"{max_model_len} tokens (prompt plus output); shorten the prompt",
            param="prompt",
        )
    if params.max_tokens is not None and params.max_tokens > room:
        raise ContextLengthExceeded(
            "the prompt ({prompt} tokens) plus {max_tokens} ({asked}) exceeds this model's "
            "context of {context} tokens; lower {max_tokens} to at most {room}",
            param="max_tokens",
            values={
                "prompt": prompt_len,
                "asked": params.max_tokens,
                "context": max_model_len,
                "room": room,
            },
        )
    if params.min_tokens > room:
        raise InvalidRequestError(
            "{min_tokens} ({asked}) is more than the {room} tokens this model's context leaves "
            "after the prompt; lower {min_tokens}",
            param="min_tokens",
            values={"asked": params.min_tokens, "room": room},
        )
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise InvalidRequestError(
            "{stop_token_ids} must be token ids in [0, {vocab}), got {value}",
            param="stop_token_ids",
            values={"vocab": vocab, "value": bad[0]},
        )
    bad = [t for t in params.logit_bias or () if t >= vocab]
    if bad:
        raise InvalidRequestError(
            "{logit_bias} keys must be token ids in [0, {vocab}), got {value}",
            param="logit_bias",
            values={"vocab": vocab, "value": bad[0]},
        )
    if params.top_k >= vocab:
        params = dataclasses.replace(params, top_k=0)
    return params
