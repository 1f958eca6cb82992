"""Tool calling for ``/v1/chat/completions``: what the chat template sees, what constrains the
output, and how each choice's text becomes an assistant message (content, reasoning, tool
calls), whole or as streamed deltas.

``tool_choice``, as OpenAI defines it:
- ``"none"``: the tools are not shown to the model; the output is content.
- ``"auto"`` (the default when tools are given): the model decides; its output is parsed by
  the server's ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``, as in vLLM).
- ``"required"``: a grammar makes the output a JSON list of one or more calls to the given
  tools (``[{"name": ..., "parameters": {...}}]``), so it always parses; exactly one with
  ``parallel_tool_calls: false``.
- ``{"type": "function", "function": {"name": N}}``: a grammar makes the output the arguments
  of N (its parameters' JSON schema); the finish reason is ``"stop"``, as OpenAI's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedrs.sampling_params import StructuredOutputsParams
from pagedrs.server.reasoning import ReasoningParser, ReasoningStream
from pagedrs.server.serving import APIError, ToolSettings
from pagedrs.server.tool_stream import ToolCall, ToolParser, ToolStream, openai_call_id

Delta = dict[str, Any]


@dataclass
class ToolPlan:
    """How one chat request uses tools."""

    mode: str
    """``"none"`` (no tools, or tool_choice none), ``"auto"``, ``"required"`` or ``"named"``."""
    tools: list[dict[str, Any]] | None = None
    """The tools as the chat template takes them (``None``: the template sees none)."""
    named: str | None = None
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    @staticmethod
    def of(body: Any, settings: ToolSettings) -> ToolPlan:
        """The plan for a request (``body``: a `ChatCompletionRequest`); bad combinations are 400s."""
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        reasoning = settings.reasoning_parser
        if isinstance(choice, str) and choice == "none" or not tools:
            if not isinstance(choice, str) or choice not in ("none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return ToolPlan("none", reasoning=reasoning)
        if choice == "auto":
            if not settings.enable_auto_tool_choice or settings.tool_parser is None:
                raise APIError(
                    400,
                    'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser',
                    param="tool_choice",
                )
            return ToolPlan("auto", tools, parser=settings.tool_parser, reasoning=reasoning)
        by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
        if choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"enum": [name]},
                        "parameters": function.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, function in by_name.items()
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if body.parallel_tool_calls is False:
                schema["maxItems"] = 1
            return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=schema))
        if not isinstance(choice, dict) or choice.get("type") != "function":
            raise APIError(
                400,
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        name = (choice.get("function") or {}).get("name")
        if name not in by_name:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        schema = by_name[name].get("parameters") or {"type": "object"}
        return ToolPlan("named", tools, named=name, constraint=StructuredOutputsParams(json=schema))

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A finished choice's assistant message, and whether it called tools."""
        reasoning_content = None
        if self.reasoning is not None:
            reasoning_content, content = self.reasoning.extract(text)
            text = content or ""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning_content is not None:
            message["reasoning_content"] = reasoning_content
        calls: list[ToolCall] = []
        if self.mode == "auto" and self.parser is not None:
            message["content"], calls = self.parser.extract(text)
        elif self.mode == "required":
            message["content"], calls = None, _required_calls(text)
        elif self.mode == "named" and self.named:
            message["content"], calls = None, [ToolCall(openai_call_id(), self.named, text)]
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, bool(calls) and self.mode != "named"

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a ``"required"`` output (the grammar made it a JSON list of calls; an
    output cut short by max_tokens is not one, and gives none)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [
        ToolCall(openai_call_id(), call["name"], json.dumps(call["parameters"], ensure_ascii=False))
        for call in calls
        if isinstance(call, dict) and "name" in call and "parameters" in call
    ]


@dataclass
class ChoiceStream:
    """One choice's text deltas in, OpenAI message deltas out."""

    plan: ToolPlan
    reasoning: ReasoningStream | None = None
    tools: ToolStream | None = None
    text: list[str] = field(default_factory=list)
    """Everything of a "required" output (sent as calls once complete)."""
    named_id: str | None = None
    saw_tool_call: bool = False

    def __post_init__(self) -> None:
        if self.plan.reasoning is not None:
            self.reasoning = self.plan.reasoning.stream()
        if self.plan.mode == "auto" and self.plan.parser is not None:
            self.tools = self.plan.parser.stream()

    def feed(self, text: str) -> list[Delta]:
        return self._after_reasoning(self.reasoning.feed(text) if self.reasoning else [{"content": text}], False)

    def finish(self) -> list[Delta]:
        return self._after_reasoning(self.reasoning.finish() if self.reasoning else [], True)

    def _after_reasoning(self, deltas: list[Delta], final: bool) -> list[Delta]:
        out: list[Delta] = []
        for delta in deltas:
            if "content" not in delta:
                out.append(delta)  # reasoning_content
            else:
                out += self._content(delta["content"])
        if final:
            out += self._finish_content()
        return [delta for delta in out if delta]

    def _content(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        if self.plan.mode == "auto" and self.tools is not None:
            deltas = self.tools.feed(text)
            self.saw_tool_call = self.tools.saw_tool_call
            return deltas
        if self.plan.mode == "required":
            self.text.append(text)
            return []
        if self.plan.mode == "named" and self.plan.named is not None:
            if self.named_id is None:
                self.named_id = openai_call_id()
                function = {"name": self.plan.named, "arguments": ""}
                deltas.append(
                    {"tool_calls": [{"index": 0, "id": self.named_id, "type": "function", "function": function}]}
                )
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        return [{"content": text}] if text else []

    def _finish_content(self) -> list[Delta]:
        if self.plan.mode == "auto" and self.tools is not None:
            deltas = self.tools.finish()
            self.saw_tool_call = self.tools.saw_tool_call
            return deltas
        if self.plan.mode == "required":
            calls = _required_calls("".join(self.text))
            self.saw_tool_call = bool(calls)
            return [{"tool_calls": [{"index": index, **call.to_openai()}]} for index, call in enumerate(calls)] or [
                {"content": "".join(self.text)}
            ]
        if self.plan.mode == "named":
            return self._content("") if self.named_id is None else []
        return []
