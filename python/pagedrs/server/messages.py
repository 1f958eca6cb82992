"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Each request is translated onto a chat completion (`start_chat`: the same template, tools,
sampling and limits) and its output rendered in Anthropic's shapes:

- ``system`` (text or text blocks) becomes a system message; ``tool_use`` blocks an assistant's
  tool calls; ``tool_result`` blocks tool messages, in order; ``thinking`` blocks of earlier
  turns are dropped (templates drop them too); images are refused.
- ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` is chat's ``auto`` / ``required`` /
  named function / ``none`` (``auto`` needs ``--enable-auto-tool-choice``, as in chat).
- ``stop_reason``: ``tool_use`` when the answer calls tools, ``max_tokens`` when cut by the
  limit, ``stop_sequence`` (with ``stop_sequence``) when one of ``stop_sequences`` ended it, else
  ``end_turn``.
- Streams are Anthropic's server-sent events: ``message_start``, per block
  ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``,
  ``thinking_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason, usage) and
  ``message_stop``; a failure mid-stream is an ``error`` event.
- Errors are Anthropic's objects (``{"type": "error", "error": {"type", "message"}}``, see
  `anthropic_error_body`); the routes take the key from ``x-api-key`` too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

from pydantic import Field
from starlette.requests import Request

from pagedrs.outputs import CompletionOutput, RequestOutput
from pagedrs.server.blocks import Block, BlockEvent, ChoiceBlocks, message_blocks
from pagedrs.server.chat import ChatRun, render_chat, start_chat
from pagedrs.server.protocol import ChatCompletionRequest, _Body
from pagedrs.server.serving import APIError, Run, Serving, check_finished, event_stream, warn_unknown_fields

# -- request bodies ------------------------------------------------------------------------------


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class _Conversation(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(_Conversation):
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Conversation):
    pass


# -- errors --------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "api_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def _error_event(error: APIError) -> str:
    body = anthropic_error_body(error.status, error.message)
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


# -- translation ---------------------------------------------------------------------------------


def _chat_messages(body: _Conversation) -> list[dict[str, Any]]:
    """The conversation as chat completion messages."""
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else "".join(block.text for block in body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls = []
        for block in message.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise APIError(400, "tool_use blocks belong to assistant messages", param="messages")
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
                )
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise APIError(400, "tool_result blocks belong to user messages", param="messages")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        if message.role == "assistant" and (texts or calls):
            messages.append(
                {"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}
            )
        elif texts:
            messages.append({"role": message.role, "content": "".join(texts)})
    return messages


def _chat_tools(body: _Conversation) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type not in ("auto", "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                **({"description": tool.description} if tool.description is not None else {}),
                "parameters": tool.input_schema,
            },
        }
        for tool in body.tools
    ]
    choice = body.tool_choice or AnthropicToolChoice(type="auto")
    chat_choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, 'tool_choice of type "tool" needs a name', param="tool_choice")
        chat_choice = {"type": "function", "function": {"name": choice.name}}
    fields: dict[str, Any] = {"tools": tools, "tool_choice": chat_choice}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _continues_final_message(messages: list[dict[str, Any]]) -> bool:
    """Whether the conversation ends with assistant text for the model to continue
    (Anthropic's prefill): the answer then goes on from that text, in the same turn."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and "tool_calls" not in last


def _chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {body.max_tokens}", param="max_tokens")
    messages = _chat_messages(body)
    prefill = _continues_final_message(messages)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "stream": body.stream,
        **_chat_tools(body),
    }
    if body.top_p is not None:
        fields["top_p"] = body.top_p
    if body.top_k is not None:
        fields["top_k"] = body.top_k
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    if not fields["messages"]:
        raise APIError(400, "messages hold no content", param="messages")
    return ChatCompletionRequest.model_validate(fields)


def _stop_reason(choice: CompletionOutput, body: MessagesRequest, called_tools: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished choice. A tool call cut
    by the limit is ``max_tokens``: its input is incomplete, so a client must not run it."""
    if choice.finish_reason in ("length", "capacity"):
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(choice.stop_reason, str) and choice.stop_reason in (body.stop_sequences or []):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _usage(run: Run, final: RequestOutput | None) -> dict[str, int]:
    """Anthropic's usage: input tokens not read from the cache, those read, and the output."""
    prompt = len(run.prompts[0].token_ids)
    cached = final.num_cached_tokens if final is not None else 0
    output = sum(len(choice.token_ids) for choice in final.outputs) if final is not None else 0
    return {
        "input_tokens": prompt - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output,
    }


def _block(block: Block) -> dict[str, Any]:
    if block.kind == "tool":
        return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments()}
    if block.kind == "thinking":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    return {"type": "text", "text": block.text}


def _message_id(run: Run) -> str:
    return "msg_" + run.request_id.rsplit("-", 1)[-1]


# -- handlers ------------------------------------------------------------------------------------


async def create_message(serving: Serving, body: MessagesRequest, raw_request: Request):
    warn_unknown_fields(body)
    chat = await start_chat(serving, _chat_request(body), prefix="msg")
    if body.stream:
        return event_stream(chat.run, _events(serving, chat, body), raw_request, error_event=_error_event, done=None)
    (final,) = await serving.run_to_end(chat.run, raw_request)
    choice = final.outputs[0]
    message, called_tools = chat.plan.message(choice.text)
    stop_reason, stop_sequence = _stop_reason(choice, body, called_tools or chat.plan.mode == "named")
    return {
        "id": _message_id(chat.run),
        "type": "message",
        "role": "assistant",
        "model": chat.run.model,
        "content": [_block(block) for block in message_blocks(message)],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat.run, final),
    }


async def _events(serving: Serving, chat: ChatRun, body: MessagesRequest) -> AsyncGenerator[str, None]:
    run, plan = chat.run, chat.plan
    usage = _usage(run, None)
    yield _event(
        "message_start",
        {
            "message": {
                "id": _message_id(run),
                "type": "message",
                "role": "assistant",
                "model": run.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            }
        },
    )
    choice_blocks = ChoiceBlocks(serving, chat)
    async for event in choice_blocks.events():
        yield _block_event(event)
    final = check_finished(choice_blocks.final)
    choice = final.outputs[0]
    stop_reason, stop_sequence = _stop_reason(choice, body, choice_blocks.stream.saw_tool_call or plan.mode == "named")
    yield _event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(run, final),  # now with the cached prompt tokens known
        },
    )
    yield _event("message_stop", {})


def _block_event(event: BlockEvent) -> str:
    kind, block, piece = event
    if kind == "start":
        start = _block(block)
        if block.kind == "tool":
            start["input"] = {}  # the arguments follow as input_json_delta
        elif block.kind == "thinking":
            start["thinking"] = ""
        else:
            start["text"] = ""
        return _event("content_block_start", {"index": block.index, "content_block": start})
    if kind == "delta":
        if block.kind == "tool":
            delta = {"type": "input_json_delta", "partial_json": piece}
        elif block.kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": piece}
        else:
            delta = {"type": "text_delta", "text": piece}
        return _event("content_block_delta", {"index": block.index, "delta": delta})
    return _event("content_block_stop", {"index": block.index})


async def count_tokens(serving: Serving, body: CountTokensRequest) -> dict[str, int]:
    """The prompt's tokens as `create_message` would render it (the tools shown to the
    template unless ``tool_choice`` is ``none``), whatever the server's tool flags."""
    warn_unknown_fields(body)
    serving.check_model(body.model)
    tools = _chat_tools(body)
    shown = tools.get("tools") if tools.get("tool_choice") != "none" else None
    messages = _chat_messages(body)
    if not messages:
        raise APIError(400, "messages hold no content", param="messages")
    conversation = ChatCompletionRequest.model_validate({"messages": messages}).conversation()
    prefill = _continues_final_message(messages)
    token_ids = await serving.tokenize(render_chat, conversation, not prefill, prefill, shown)
    return {"input_tokens": len(token_ids)}
