"""Tool-call parsers: a model's tool-call markup, read out of its output as OpenAI ``tool_calls``.

vLLM's ``--tool-call-parser``, under vLLM's names (``TOOL_PARSERS``). A parser reads one output
in two ways that always agree: ``extract`` on the finished text, and ``stream()`` delta by delta.
``extract`` is a stream fed the whole text at once, so there is one state machine, and the
deltas of any chunking of an output reassemble to exactly what ``extract`` returns.

An output is content with call regions in it::

    I'll look it up.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
    |---- content ----||------------------------- call region ------------------------|

- A region opens at the parser's marker and ends where the parser's scanner says. Its text
  becomes one or more calls, or, when malformed (bad JSON, no name, cut off by the end of the
  output), comes back verbatim as content. Nothing here raises on model output.
- Content is the text outside the regions that became calls. The whitespace after such a
  region is dropped, and so is the whitespace before it unless content follows (then that
  whitespace still separates the content on either side); content that is only whitespace is
  None. An output without calls is its own content, byte for byte.
- Streaming holds back text that may be the start of a marker until the next characters decide
  it, and whitespace until the next text shows whether it is kept, so a client never sees half
  a marker, nor a newline that ``extract`` would have dropped.

NOTE: a call's deltas (its header, then its arguments as one fragment) are sent only once its
whole region has been read and validated. Streaming arguments token by token could send a call
that the end of its region then shows to be malformed, and a delta can't be taken back; this
way the streamed calls are always exactly ``extract``'s.

Mistral's ``[TOOL_CALLS]`` and Llama's ``<|python_tag|>`` are special tokens: they reach the text
only when the output is detokenized with ``skip_special_tokens=False``
(``ToolParser.needs_special_tokens``).
"""

from __future__ import annotations

import re

from pagedrs.server.tool_stream import (
    JsonSpan,
    RegionScanner,
    ToolParser,
    arguments_text,
    loads_json,
    name_and_arguments,
    partial_marker_length,
    random_id,
    skip_whitespace,
)


class _EndMarkerScanner:
    """A region that ends just past the first end marker."""

    def __init__(self, start_marker: str, end_marker: str) -> None:
        self._end_marker = end_marker
        self._search_from = len(start_marker)

    def scan(self, region: str) -> int | None:
        end = region.find(self._end_marker, self._search_from)
        if end >= 0:
            return end + len(self._end_marker)
        self._search_from = max(self._search_from, len(region) - len(self._end_marker) + 1)
        return None


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, any number of
    them, anywhere (Hermes, Qwen2.5, Qwen3); ``"parameters"`` is accepted for ``"arguments"``.
    A block cut off by the end of the output (even inside ``</tool_call>``) is still a call if its
    JSON is complete."""

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def new_scanner(self) -> RegionScanner:
        return _EndMarkerScanner(self.start_marker, self.end_marker)

    def parse_region(self, region: str) -> list[tuple[str, str]]:
        body = region[len(self.start_marker) :]
        if body.endswith(self.end_marker):
            body = body[: -len(self.end_marker)]
        else:  # cut off by the end of the output; JSON never ends in a piece of the marker
            body = body[: len(body) - partial_marker_length(body, self.end_marker)]
        return [name_and_arguments(loads_json(body), ("arguments", "parameters"), arguments_required=False)]


# Keys a Llama call object may open with; anything else at the head of a "{" is an ordinary
# JSON answer, sent as content at once instead of being held until its closing brace.
_LLAMA_CALL_KEYS = ("name", "parameters", "arguments", "type")


def _opens_llama_call(text: str) -> bool | None:
    """Whether an object starting as ``text`` (at its "{") opens with a call's key; None: undecided."""
    rest = text[1:].lstrip()
    if not rest:
        return None
    if rest[0] != '"':
        return False
    key_end = rest.find('"', 1)
    if key_end < 0:
        return None if any(key.startswith(rest[1:]) for key in _LLAMA_CALL_KEYS) else False
    return rest[1:key_end] in _LLAMA_CALL_KEYS


class _LlamaScanner:
    """``<|python_tag|>``, ``;`` or nothing, whitespace, then one JSON object."""

    def __init__(self) -> None:
        self._span: JsonSpan | None = None

    def scan(self, region: str) -> int | None:
        if self._span is None:
            start = skip_whitespace(region, len(_llama_prefix(region)))
            if start == len(region):
                return None
            if region[start] != "{":
                return start  # the prefix alone: it has at least one character
            opens_call = _opens_llama_call(region[start:])
            if opens_call is None:
                return None
            if not opens_call:
                return len(region)
            self._span = JsonSpan(start)
        return self._span.end(region)


_PYTHON_TAG = "<|python_tag|>"


def _llama_prefix(region: str) -> str:
    for prefix in (_PYTHON_TAG, ";"):
        if region.startswith(prefix):
            return prefix
    return ""


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x's JSON calls: an output that is ``{"name": ..., "parameters": {...}}``, maybe
    after ``<|python_tag|>``, and more such objects after ``;`` (``"arguments"`` is accepted for
    ``"parameters"``).

    Calls are only read at the start of the output or right after another call: an output that
    opens with text is all content, and text after the calls is content.
    """

    name = "llama3_json"
    needs_special_tokens = True

    def find_region(self, text: str, at_boundary: bool, after_call: bool) -> int | None:
        if not at_boundary:
            return None
        start = skip_whitespace(text, 0)
        if text.startswith((_PYTHON_TAG, "{"), start) or (after_call and text.startswith(";", start)):
            return start
        return None

    def held_length(self, text: str, at_boundary: bool) -> int:
        rest = text.lstrip()
        return len(rest) if at_boundary and rest and _PYTHON_TAG.startswith(rest) else 0

    def new_scanner(self) -> RegionScanner:
        return _LlamaScanner()

    def parse_region(self, region: str) -> list[tuple[str, str]]:
        prefix = _llama_prefix(region)
        body = region[len(prefix) :].strip()
        if prefix == ";" and not body:
            return []  # a separator after the last call is markup too
        return [name_and_arguments(loads_json(body), ("parameters", "arguments"), arguments_required=True)]


_MISTRAL_ARGS = "[ARGS]"
_MISTRAL_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")


class _MistralScanner:
    """After ``[TOOL_CALLS]``: a JSON list (or object), or a name, ``[ARGS]`` and a JSON object."""

    def __init__(self, marker: str) -> None:
        self._marker = marker
        self._span: JsonSpan | None = None

    def scan(self, region: str) -> int | None:
        if self._span is None:
            start = skip_whitespace(region, len(self._marker))
            if start == len(region):
                return None
            if region[start] not in "[{":
                name_match = _MISTRAL_NAME_CHARS.match(region, start)
                name_end = name_match.end() if name_match else start
                after_name = region[name_end:]
                if not after_name.startswith(_MISTRAL_ARGS):
                    return None if _MISTRAL_ARGS.startswith(after_name) else name_end
                start = skip_whitespace(region, name_end + len(_MISTRAL_ARGS))
                if start == len(region):
                    return None
                if region[start] != "{":
                    return start
            self._span = JsonSpan(start)
        return self._span.end(region)


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11), and
    ``[TOOL_CALLS]name[ARGS]{...}``, one marker per call (v11 and later)."""

    name = "mistral"
    needs_special_tokens = True
    start_marker = "[TOOL_CALLS]"

    def new_call_id(self) -> str:
        """9 letters and digits: Mistral's chat templates reject any other tool_call_id when the
        conversation comes back with the tool's answer."""
        return random_id(9)

    def new_scanner(self) -> RegionScanner:
        return _MistralScanner(self.start_marker)

    def parse_region(self, region: str) -> list[tuple[str, str]]:
        body = region[len(self.start_marker) :].lstrip()
        if body.startswith(("[", "{")):
            value = loads_json(body)
            calls = value if isinstance(value, list) else [value]
            if not calls:
                raise ValueError("an empty list of tool calls")
            return [name_and_arguments(call, ("arguments", "parameters"), arguments_required=False) for call in calls]
        name, separator, arguments = body.partition(_MISTRAL_ARGS)
        if not separator or not name or not _MISTRAL_NAME_CHARS.fullmatch(name):
            raise ValueError("a tool call is name[ARGS]{...}")
        return [(name, arguments_text(loads_json(arguments)))]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
