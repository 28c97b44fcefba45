"""Extended thinking on the Messages API, mapped onto the model's reasoning parser.

`thinking: {"type": "enabled", "budget_tokens": N}` asks the template for a reasoning effort
by the budget (`output_config.effort` names one directly), `disabled` for the lowest one and
hides the reasoning; a model without a reasoning parser writes none either way. Each
`thinking` block carries a `signature`: an HMAC of its text under the server's secret
(`$EXPRESSLANE_THINKING_SECRET`, else one drawn per process), so that a block a client sends
back is rendered into the prompt only if this server wrote it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets

from expresslane.server.errors import invalid
from expresslane.server.messages_schema import CountTokensRequest

_SECRET = os.environ.get("EXPRESSLANE_THINKING_SECRET", "").encode() or secrets.token_bytes(32)
# budget_tokens below each bound -> that effort (Anthropic's minimum budget is 1024)
_EFFORTS = ((4096, "low"), (16384, "medium"))


def effort(body: CountTokensRequest) -> str | None:
    """The reasoning effort the template is given (None: the model's default)."""
    if body.output_config is not None and body.output_config.effort is not None:
        return body.output_config.effort
    thinking = body.thinking
    if thinking is None or thinking.type == "adaptive":
        return None
    if thinking.type == "disabled":
        return "low"
    return next((name for bound, name in _EFFORTS if thinking.budget_tokens < bound), "high")


def shows_thinking(body: CountTokensRequest) -> bool:
    return body.thinking is None or body.thinking.type != "disabled"


def sign(text: str) -> str:
    digest = hmac.new(_SECRET, text.encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def check_signature(block: dict, param: str) -> None:
    """400 for a thinking block this server did not write (or that was changed)."""
    text, signature = block.get("thinking"), block.get("signature")
    if not isinstance(text, str) or not isinstance(signature, str):
        raise invalid(
            f"'{param}' needs 'thinking' and 'signature' strings.", param=f"{param}.signature"
        )
    if not hmac.compare_digest(sign(text), signature):
        raise invalid(
            f"'{param}.signature' does not match its thinking: send thinking blocks back "
            "exactly as this server returned them.",
            param=f"{param}.signature",
        )
