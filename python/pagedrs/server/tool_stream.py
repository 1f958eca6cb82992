"""What every tool-call parser shares: the OpenAI delta shapes, the text channel that holds back a
possible marker, the JSON-region helpers, the `ToolParser` base and its `ToolStream`. The
format of the streamed calls and why they are sent whole: `pagedrs.server.tool_parsers`."""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

# One OpenAI streaming ``delta`` object: {"content": ...} or {"tool_calls": [...]}.
Delta = dict[str, Any]

_ALPHANUMERIC = string.ascii_letters + string.digits


def random_id(length: int) -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length))


def openai_call_id() -> str:
    """OpenAI's form: "call_" and 24 random letters and digits."""
    return "call_" + random_id(24)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, the way OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        """The call as an entry of an OpenAI message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (0 if none)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class TextChannel:
    """The text of one delta field, with the whitespace around markup dropped.

    The whitespace after markup is dropped. The whitespace before markup is kept only when text
    comes both before and after the markup, where it still separates the two; several markups
    in a row count as one. Whitespace is held until the next text shows which case it is, and a
    channel that never saw anything but whitespace sends nothing.
    """

    def __init__(self, after_markup: bool = False) -> None:
        self._pending_whitespace = ""  # ends the text sent, or came before the last markup
        self._after_markup = after_markup
        self._has_text = False

    @property
    def at_boundary(self) -> bool:
        """Nothing but whitespace since the start or the last markup."""
        return self._after_markup or not self._has_text

    def push(self, text: str) -> str:
        """What of ``text``, and of the whitespace held before it, can be sent now."""
        if self._after_markup:
            text = text.lstrip()
            if not text:
                return ""
            self._after_markup = False
        text = self._pending_whitespace + text
        body = text.rstrip()
        self._pending_whitespace = text[len(body) :]
        if body:
            self._has_text = True
        return body

    def markup(self) -> None:
        """Markup comes here (a call region, a tag)."""
        if not self._has_text:
            self._pending_whitespace = ""
        self._after_markup = True

    def finish(self) -> str:
        """The whitespace still held, if it ends text rather than coming before markup."""
        text = self._pending_whitespace if self._has_text and not self._after_markup else ""
        self._pending_whitespace = ""
        return text


def append_text(deltas: list[Delta], field: str, text: str) -> None:
    """Add ``text`` to ``deltas``, merged into the last delta when that one is the same field's."""
    if not text:
        return
    if deltas and field in deltas[-1]:
        deltas[-1][field] += text
    else:
        deltas.append({field: text})


class JsonSpan:
    """Where a JSON object or array ends, read incrementally: brackets matched outside strings.

    It doesn't validate; json.loads does that on the span it finds.
    """

    _CLOSING = {"{": "}", "[": "]"}

    def __init__(self, start: int) -> None:
        self._position = start  # text[start] is "{" or "["
        self._expected_closers: list[str] = []
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket (or past a mismatched one); None while still open."""
        position = self._position
        while position < len(text):
            char = text[position]
            position += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._expected_closers.append(self._CLOSING[char])
            elif char in "}]":
                if not self._expected_closers or self._expected_closers.pop() != char:
                    return position  # mismatched: json.loads rejects the span
                if not self._expected_closers:
                    return position
        self._position = position
        return None


class RegionScanner(Protocol):
    def scan(self, region: str) -> int | None:
        """Length of the call region at the start of ``region`` (at least 1), or None until more
        text decides it. Called again with the same text plus more; at the end of the output
        a region still undecided takes all the rest."""
        ...


_WHITESPACE = re.compile(r"\s*")


def skip_whitespace(text: str, position: int) -> int:
    match = _WHITESPACE.match(text, position)
    return match.end() if match else position


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> Any:
    # NaN and Infinity: Python's json reads them, but a client's JSON parser would not.
    return json.loads(text, parse_constant=_reject_constant)


def arguments_text(value: Any) -> str:
    if isinstance(value, str):  # some models send the arguments object JSON-encoded in a string
        value = loads_json(value)
    if not isinstance(value, dict):
        raise ValueError("a tool call's arguments are a JSON object")
    return json.dumps(value, ensure_ascii=False)


def name_and_arguments(call: Any, arguments_keys: tuple[str, ...], arguments_required: bool) -> tuple[str, str]:
    """(name, arguments as JSON text) of a call object, or ValueError."""
    if not isinstance(call, dict):
        raise ValueError("a tool call is a JSON object")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call names its function")
    for key in arguments_keys:
        if key in call:
            return name, arguments_text(call[key])
    if arguments_required:
        raise ValueError(f"a tool call has one of {arguments_keys}")
    return name, "{}"


class ToolParser:
    """A model family's tool-call format. Holds no per-output state: one per server is enough."""

    name: ClassVar[str]
    # The markers are special tokens: detokenize with skip_special_tokens=False.
    needs_special_tokens: ClassVar[bool] = False
    # Where a region opens, for formats with a single marker anywhere in the output.
    start_marker: ClassVar[str] = ""

    def new_call_id(self) -> str:
        return openai_call_id()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output; content is None when empty or whitespace."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        content = "".join(delta.get("content", "") for delta in deltas)
        return content or None, stream.tool_calls

    def stream(self) -> ToolStream:
        """A reader for one choice's output, fed delta by delta."""
        return ToolStream(self)

    # The format: what a subclass defines.

    def find_region(self, text: str, at_boundary: bool, after_call: bool) -> int | None:
        """Where the first call region in ``text`` opens, if one does.

        ``at_boundary``: nothing but whitespace was sent since the start or the last call;
        ``after_call``: that last call exists.
        """
        start = text.find(self.start_marker)
        return start if start >= 0 else None

    def held_length(self, text: str, at_boundary: bool) -> int:
        """How much of the end of ``text`` (which has no region) might still open one."""
        return partial_marker_length(text, self.start_marker)

    def new_scanner(self) -> RegionScanner:
        raise NotImplementedError

    def parse_region(self, region: str) -> list[tuple[str, str]]:
        """(name, arguments) of each call in a region; ValueError when it is malformed."""
        raise NotImplementedError


class DeltaStream:
    """Text fed delta by delta into a buffer; `_advance` (the subclass's) decides what of it
    can be sent, and `finish` flushes what was held back, the content channel last."""

    def __init__(self) -> None:
        self._buffer = ""
        self._content = TextChannel()
        self._finished = False

    def feed(self, delta_text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish(): this output is complete")
        self._buffer += delta_text
        return self._advance(final=False)

    def finish(self) -> list[Delta]:
        """The end of the output: everything held back is decided and sent."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        deltas = self._advance(final=True)
        append_text(deltas, "content", self._content.finish())
        self._finished = True
        return deltas

    def _advance(self, final: bool) -> list[Delta]:
        raise NotImplementedError


class ToolStream(DeltaStream):
    """One choice's output fed delta by delta, giving OpenAI streaming deltas.

    ``feed`` and ``finish`` return ``{"content": ...}`` deltas and, per call, a header
    ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}``
    then ``{"tool_calls": [{"index", "function": {"arguments": ...}}]}``.
    """

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()  # the buffer: a tail that may open a region, or the call region read so far
        self._parser = parser
        self._scanner: RegionScanner | None = None  # set while the buffer starts with a call region
        self.tool_calls: list[ToolCall] = []

    @property
    def saw_tool_call(self) -> bool:
        """Whether any call was sent (the choice's finish_reason is then "tool_calls")."""
        return bool(self.tool_calls)

    def _advance(self, final: bool) -> list[Delta]:
        deltas: list[Delta] = []
        while True:
            if self._scanner is None:
                start = self._parser.find_region(self._buffer, self._content.at_boundary, self.saw_tool_call)
                if start is None:
                    num_held = 0 if final else self._parser.held_length(self._buffer, self._content.at_boundary)
                    self._send_content(deltas, self._buffer[: len(self._buffer) - num_held])
                    self._buffer = self._buffer[len(self._buffer) - num_held :]
                    return deltas
                self._send_content(deltas, self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._scanner = self._parser.new_scanner()
            end = self._scanner.scan(self._buffer)
            if end is None:
                if not final:
                    return deltas
                end = len(self._buffer)
            region, self._buffer = self._buffer[:end], self._buffer[end:]
            self._scanner = None
            try:
                calls = self._parser.parse_region(region)
            except (ValueError, RecursionError):  # malformed (RecursionError: absurdly deep JSON)
                self._send_content(deltas, region)
                continue
            self._content.markup()
            for name, arguments in calls:
                self._send_call(deltas, name, arguments)

    def _send_content(self, deltas: list[Delta], text: str) -> None:
        append_text(deltas, "content", self._content.push(text))

    def _send_call(self, deltas: list[Delta], name: str, arguments: str) -> None:
        index = len(self.tool_calls)
        call = ToolCall(self._parser.new_call_id(), name, arguments)
        self.tool_calls.append(call)
        header = {"name": name, "arguments": ""}
        deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": header}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
