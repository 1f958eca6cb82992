"""A chat choice's message as content blocks (text, thinking, tool calls), whole or as a
stream of block events: what Anthropic's Messages API and OpenAI's Responses API render, each
in its own shape, from the chat path's OpenAI message (`ToolPlan.message`) and deltas
(`ChoiceStream`)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pagedrs.outputs import RequestOutput
from pagedrs.server.serving import APIError, Serving, check_failed, check_finished

if TYPE_CHECKING:
    from pagedrs.server.chat import ChatRun

BlockKind = Literal["text", "thinking", "tool"]


@dataclass
class Block:
    kind: BlockKind
    index: int
    """Its position among the message's blocks."""
    text: str = ""
    """The text, the reasoning, or a tool call's arguments (JSON text) so far."""
    call_id: str | None = None
    name: str | None = None

    def arguments(self) -> dict[str, Any]:
        """A tool call's arguments as an object. A call cut short by the token limit is not
        valid JSON: its arguments are then empty, and the stop reason says it was cut."""
        try:
            value = json.loads(self.text or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


def message_blocks(message: dict[str, Any]) -> list[Block]:
    """A finished OpenAI assistant message (`ToolPlan.message`) as blocks."""
    blocks: list[Block] = []
    if message.get("reasoning_content"):
        blocks.append(Block("thinking", len(blocks), message["reasoning_content"]))
    if message.get("content"):
        blocks.append(Block("text", len(blocks), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(Block("tool", len(blocks), function["arguments"], call["id"], function["name"]))
    return blocks


BlockEvent = tuple[Literal["start", "delta", "stop"], Block, str]
"""``("start", block, "")``, ``("delta", block, piece)`` or ``("stop", block, "")``."""


@dataclass
class BlockStream:
    """OpenAI message deltas (`ChoiceStream`) in, block events out: a block starts when its
    kind changes or a tool call begins, and stops when the next starts or the message ends."""

    blocks: list[Block] = field(default_factory=list)
    open: Block | None = None

    def feed(self, deltas: list[dict[str, Any]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id") is not None:
                    events += self._start(
                        Block("tool", len(self.blocks), call_id=call["id"], name=function.get("name"))
                    )
                arguments = function.get("arguments") or ""
                if arguments:
                    if self.open is None or self.open.kind != "tool":
                        raise APIError(500, "a tool call's arguments came before the call", "InternalServerError")
                    self.open.text += arguments
                    events.append(("delta", self.open, arguments))
        return events

    def close(self) -> list[BlockEvent]:
        """Stops the open block (the message has ended)."""
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [("stop", block, "")]

    def _text(self, kind: BlockKind, piece: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self.open is None or self.open.kind != kind:
            events += self._start(Block(kind, len(self.blocks)))
        assert self.open is not None
        self.open.text += piece
        events.append(("delta", self.open, piece))
        return events

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self.open = block
        events.append(("start", block, ""))
        return events


class ChoiceBlocks:
    """A streamed chat run's one choice as block events: its text through the chat path's tool
    and reasoning parsing (`ToolPlan.stream`), then `BlockStream`. After the events, `final`
    holds the run's last output (an engine failure or an unfinished run raises `APIError`)."""

    def __init__(self, serving: Serving, chat: ChatRun):
        self.serving, self.run = serving, chat.run
        self.stream = chat.plan.stream()
        self.final: RequestOutput | None = None

    async def events(self) -> AsyncGenerator[BlockEvent, None]:
        blocks = BlockStream()
        sent = 0
        async for _, output in self.serving.outputs(self.run):
            check_failed(output)
            self.final = output
            choice = output.outputs[0]
            text = choice.text[sent:]
            sent = len(choice.text)
            deltas = self.stream.feed(text) if text else []
            if choice.finished():
                deltas += self.stream.finish()
            for event in blocks.feed(deltas):
                yield event
        for event in blocks.close():
            yield event
        self.final = check_finished(self.final)
