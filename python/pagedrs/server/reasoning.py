"""Reasoning parsers: a ``<think>...</think>`` block split off the output as ``reasoning_content``.

vLLM's ``--reasoning-parser``, under vLLM's names (``REASONING_PARSERS``):

- ``qwen3``: reasoning only when ``<think>`` opens the output (after any whitespace). Without it
  the output is all content: with ``enable_thinking=False`` Qwen3's template closes the think
  block in the prompt.
- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output may lack it.
  Everything before the first ``</think>`` is reasoning, and an output without ``</think>`` (cut
  off while thinking) is all reasoning.

Both read an output in two ways that always agree, as the tool parsers do: ``extract`` is a
stream fed the whole text at once. reasoning_content has its surrounding whitespace stripped;
content loses the whitespace touching ``</think>`` and is otherwise verbatim; either is None
when empty or whitespace. Streaming holds back what may be a partial tag (and whitespace,
until what it touches is known), so a client never sees half a tag. An output cut off inside
the think block (qwen3 too) gives reasoning and no content, the same both ways.

The content deltas are what a tool parser reads next: feed their text to its stream.
"""

from __future__ import annotations

import enum
from typing import ClassVar

from pagedrs.server.tool_stream import Delta, DeltaStream, TextChannel, append_text, partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """A ``<think>`` format. Holds no per-output state: one per server is enough."""

    name: ClassVar[str]
    # The output may start inside the think block, its <think> being in the prompt.
    starts_thinking: ClassVar[bool]

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        reasoning = "".join(delta.get("reasoning_content", "") for delta in deltas)
        content = "".join(delta.get("content", "") for delta in deltas)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        """A reader for one choice's output, fed delta by delta."""
        return ReasoningStream(self.starts_thinking)


class _Phase(enum.Enum):
    OPENING = "opening"  # whether the output opens with <think> is not known yet
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream(DeltaStream):
    """One choice's output fed delta by delta: ``{"reasoning_content": ...}`` and
    ``{"content": ...}`` deltas, in the output's order."""

    def __init__(self, starts_thinking: bool) -> None:
        super().__init__()  # the buffer: the opening, or a tail that may start </think>
        self._starts_thinking = starts_thinking
        self._phase = _Phase.OPENING
        self._reasoning = TextChannel(after_markup=True)

    @property
    def in_reasoning(self) -> bool:
        """Whether the output read so far is still (or may still be) reasoning."""
        return self._phase is _Phase.REASONING or (self._phase is _Phase.OPENING and self._starts_thinking)

    # NOTE: `finish` never sends the reasoning channel's held whitespace: reasoning_content
    # is stripped.

    def _advance(self, final: bool) -> list[Delta]:
        deltas: list[Delta] = []
        if self._phase is _Phase.OPENING:
            rest = self._buffer.lstrip()
            if rest.startswith(THINK_START):
                self._buffer = rest[len(THINK_START) :]
                self._phase = _Phase.REASONING
            elif THINK_START.startswith(rest) and not final:
                return deltas  # "", or a start of "<think>"
            else:
                self._phase = _Phase.REASONING if self._starts_thinking else _Phase.CONTENT
        if self._phase is _Phase.REASONING:
            end = self._buffer.find(THINK_END)
            if end < 0:
                num_held = 0 if final else partial_marker_length(self._buffer, THINK_END)
                sendable = len(self._buffer) - num_held
                append_text(deltas, "reasoning_content", self._reasoning.push(self._buffer[:sendable]))
                self._buffer = self._buffer[sendable:]
                return deltas
            append_text(deltas, "reasoning_content", self._reasoning.push(self._buffer[:end]))
            self._reasoning.markup()
            self._content.markup()
            self._buffer = self._buffer[end + len(THINK_END) :]
            self._phase = _Phase.CONTENT
        append_text(deltas, "content", self._content.push(self._buffer))
        self._buffer = ""
        return deltas


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_thinking = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_thinking = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None
