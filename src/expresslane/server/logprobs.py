"""Engine logprobs ({"token": lp, "top": [(id, lp), ...]} per token) in the API's shapes."""

from __future__ import annotations

from collections.abc import Callable


def _texts(tokenizer) -> Callable[[int], str]:
    """A token's text by id (a model served without a tokenizer names ids)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return tokenizer.token_text


def _entry(text_of: Callable[[int], str], token_id: int, logprob: float) -> dict:
    text = text_of(token_id)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict]) -> list[dict]:
    """Chat Completions / Responses form: token, logprob, bytes, top_logprobs."""
    out = []
    text_of = _texts(tokenizer)
    for tid, lp in zip(token_ids, logprobs, strict=False):
        e = _entry(text_of, tid, lp["token"])
        e["top_logprobs"] = [_entry(text_of, t, v) for t, v in lp.get("top", ())]
        out.append(e)
    return out


def completion_logprobs(
    tokenizer, token_ids: list[int], logprobs: list[dict | None], offset: int
) -> dict:
    """Legacy Completions form: tokens, token_logprobs, top_logprobs, text_offset (a None
    entry, the first prompt token's, gives nulls)."""
    tokens, values, tops, offsets = [], [], [], []
    text_of = _texts(tokenizer)
    for tid, lp in zip(token_ids, logprobs, strict=False):
        text = text_of(tid)
        tokens.append(text)
        if lp is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(float(lp["token"]))
            tops.append({text_of(t): float(v) for t, v in lp.get("top", ())})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
