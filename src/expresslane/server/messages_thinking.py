"""Extended thinking on the Messages API, mapped onto the model's reasoning parser.

`thinking: {"type": "enabled", "budget_tokens": N}` asks the template for a reasoning effort
by the budget (`output_config.effort` names one directly), `disabled` for the lowest one and
hides the reasoning; a model without a reasoning parser writes none either way. Each
`thinking` block carries a `signature` (`Sealer.sign`: an HMAC of its text for the key's owner
under the accounts database's key, so every server sharing it, restarted or not, verifies it),
so that a block a client sends back is rendered into the prompt only if this server wrote it.
"""

from __future__ import annotations

from collections.abc import Callable

from expresslane.server.errors import invalid
from expresslane.server.messages_schema import CountTokensRequest
from expresslane.server.sealing import Sealer

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


def signature_checker(sealer: Sealer, owner: str) -> Callable[[dict, str], None]:
    """What checks the thinking blocks `owner` sends back."""

    def check(block: dict, param: str) -> None:
        """400 for a thinking block this server did not write (or that was changed)."""
        text, signature = block.get("thinking"), block.get("signature")
        if not isinstance(text, str) or not isinstance(signature, str):
            raise invalid(
                f"'{param}' needs 'thinking' and 'signature' strings.", param=f"{param}.signature"
            )
        if not sealer.verify(owner, text, signature):
            raise invalid(
                f"'{param}.signature' does not match its thinking: send thinking blocks back "
                "exactly as this server returned them.",
                param=f"{param}.signature",
            )

    return check
