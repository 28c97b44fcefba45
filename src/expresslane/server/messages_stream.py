"""A streamed Messages response, event for event as Anthropic streams one: `message_start`,
`ping`, the content blocks' `content_block_start` / `content_block_delta` /
`content_block_stop`, then `message_delta` (stop reason and the final usage, cumulative)
and `message_stop`; an `error` event if the generation fails once started."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from expresslane.server.anthropic_errors import error_body
from expresslane.server.errors import APIError
from expresslane.server.generation import Generation, merged
from expresslane.server.messages_output import MessageBuilder, usage
from expresslane.server.sse import event


@dataclass
class Reply:
    """What a message's envelope and usage need besides its blocks."""

    head: dict  # id, type, role, model
    prompt_tokens: int
    lane: str
    stops: list[str] | None

    def message(self, builder: MessageBuilder) -> dict:
        """The whole message once its generation finished."""
        reason, sequence = builder.stop(self.stops)
        return {
            **self.head,
            "content": builder.blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(builder.choice.final, self.prompt_tokens, self.lane),
        }


async def message_events(
    gens: list[Generation], builder: MessageBuilder, reply: Reply
) -> AsyncIterator[str]:
    start = {
        **reply.head,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(None, reply.prompt_tokens, reply.lane),
    }
    yield event("message_start", {"type": "message_start", "message": start})
    yield event("ping", {"type": "ping"})
    try:
        async for _, out in merged(gens):
            for name, data in builder.add(out):
                yield event(name, data)
    except APIError as e:
        yield event("error", error_body(e))
        return
    final = reply.message(builder)
    delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
    yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": final["usage"]})
    yield event("message_stop", {"type": "message_stop"})
