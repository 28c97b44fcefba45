"""A Responses `reasoning` output item as its text arrives, with its stream events:
output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
content_part.done, output_item.done (the openai SDK's reasoning events)."""

from __future__ import annotations

from collections.abc import Callable

from expresslane.server.prompt import new_id


class ReasoningItem:
    def __init__(
        self,
        output: list[dict],
        emit: Callable[[dict], None],
        seal: Callable[[str], str] | None = None,
    ):
        """`seal`: its text comes back sealed in `encrypted_content` too (`sealing.py`)."""
        self.emit = emit
        self.seal = seal
        self.part = {"type": "reasoning_text", "text": ""}
        self.item = {
            "id": new_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [],
            "status": "in_progress",
        }
        self.index = len(output)
        output.append(self.item)
        emit({"type": "response.output_item.added", "output_index": self.index, "item": self.item})
        self.item["content"].append(self.part)
        self._part_event("response.content_part.added")

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": self.index, "content_index": 0}

    def _part_event(self, kind: str) -> None:
        self.emit({"type": kind, **self._where(), "part": self.part})

    def add(self, text: str) -> None:
        self.part["text"] += text
        self.emit({"type": "response.reasoning_text.delta", **self._where(), "delta": text})

    def close(self, status: str = "completed") -> None:
        text = self.part["text"]
        self.emit({"type": "response.reasoning_text.done", **self._where(), "text": text})
        self._part_event("response.content_part.done")
        if self.seal is not None:
            self.item["encrypted_content"] = self.seal(text)
        self.item["status"] = status
        self.emit(
            {"type": "response.output_item.done", "output_index": self.index, "item": self.item}
        )
