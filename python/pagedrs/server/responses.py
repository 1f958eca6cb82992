"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

Each request is translated onto a chat completion (`start_chat`: the same template, tools,
structured outputs, sampling and limits) and its output rendered as Responses items:

- ``input`` is text or a list of items: messages (``user`` / ``system`` / ``developer`` /
  ``assistant``, text content), ``function_call`` and ``function_call_output`` items (an
  assistant's tool call and its result); ``instructions`` is a system message first (not
  carried to later turns, as OpenAI's). Images, files and hosted tools are refused.
- ``text.format`` ``json_schema`` / ``json_object`` constrain the output (structured outputs);
  ``tools`` are function tools with chat's ``tool_choice`` semantics.
- ``store`` (default true) keeps the response and its conversation in `ResponseStore`, an
  in-memory LRU bounded by count and size: ``previous_response_id`` continues it, ``GET``
  reads it, ``DELETE`` drops it. An unknown or evicted id is a 404, never ignored.
- Streams are the Responses events (``response.created``, ``response.output_item.added``,
  ``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
  ``response.completed``, or ``response.incomplete`` when cut by ``max_output_tokens``), each
  with its ``sequence_number``.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request

from pagedrs.outputs import CompletionOutput, RequestOutput
from pagedrs.server.blocks import Block, ChoiceBlocks, message_blocks
from pagedrs.server.chat import ChatRun, start_chat
from pagedrs.server.protocol import ChatCompletionRequest, _Body
from pagedrs.server.serving import APIError, Run, Serving, check_finished, error_body, event_stream, warn_unknown_fields

logger = logging.getLogger(__name__)

# -- request bodies ------------------------------------------------------------------------------


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Body):
    type: Literal["text", "json_schema", "json_object"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False


# -- the store -----------------------------------------------------------------------------------


@dataclass
class _Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    """The chat messages up to and including this response's output (no instructions)."""
    size: int


class ResponseStore:
    """Stored responses, least recently used dropped first: at most ``max_responses`` of
    them, and at most ``max_bytes`` of their JSON together. One response may take at most an
    eighth of ``max_bytes`` (a larger one is not stored, and logged), so a single client cannot
    flush everyone else's. Thread-safe."""

    def __init__(self, max_responses: int = 1024, max_bytes: int = 64 * 2**20):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes // 8:
            logger.warning(
                "%s: not stored: %d bytes, above the store's limit for one response (%d)",
                response["id"],
                size,
                self.max_bytes // 8,
            )
            return
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = _Stored(response, conversation, size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> _Stored | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found (never stored, deleted, or evicted from the server's store).",
        "NotFoundError",
        param,
    )


# -- translation ---------------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or text parts (``input_text`` / ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be text or a list of text parts", param="input")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}.content[{index}] must be an input_text or output_text part (got {kind!r}); "
                "images and files are not supported",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    400, f"{where}.role must be user, assistant, system or developer, got {role!r}", param="input"
                )
            text = _text_of(item.get("content"), where)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not all(isinstance(value, str) for value in (call_id, name, arguments)):
                raise APIError(400, f"{where} needs call_id, name and arguments as strings", param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise APIError(400, f"{where} needs call_id and output as strings", param="input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning: templates drop it
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its conversation."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"] if "text" in part
    )
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    if body.background:
        raise APIError(400, "background responses are not supported", param="background")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(
            400, f"max_output_tokens must be at least 1, got {body.max_output_tokens}", param="max_output_tokens"
        )
    messages = history + _input_messages(body.input)
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    if not messages:
        raise APIError(400, "input must not be empty", param="input")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise APIError(
                    400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
                )
            choice = {"type": "function", "function": {"name": choice["name"]}}
        fields["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise APIError(400, "text.format json_schema needs a schema", param="text")
        schema = {"name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    return ChatCompletionRequest.model_validate(fields)


# -- the response object -------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item(block: Block, item_id: str, status: str = "completed") -> dict[str, Any]:
    if block.kind == "tool":
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.text,
            "status": status,
        }
    content = [_part(block.kind, block.text)] if block.text else []
    if block.kind == "thinking":
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _part(kind: str, text: str) -> dict[str, Any]:
    """The content part of a message's text or of a reasoning item's text."""
    if kind == "thinking":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


_ITEM_PREFIXES = {"tool": "fc", "thinking": "rs", "text": "msg"}


def _incomplete(choice: CompletionOutput | None) -> bool:
    return choice is not None and choice.finish_reason in ("length", "capacity")


def _response(
    body: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    run: Run,
    final: RequestOutput | None,
) -> dict[str, Any]:
    prompt = len(run.prompts[0].token_ids)
    completion = sum(len(choice.token_ids) for choice in final.outputs) if final is not None else 0
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "model": model,
        "output": output,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "text": text or {"format": {"type": "text"}},
        "metadata": body.metadata or {},
        "user": body.user,
        "truncation": "disabled",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "usage": None
        if final is None
        else {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


# -- handlers ------------------------------------------------------------------------------------


async def create_response(serving: Serving, store: ResponseStore, body: ResponsesRequest, raw_request: Request):
    warn_unknown_fields(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = [dict(message) for message in previous.conversation]
    request = _chat_request(body, history)
    chat = await start_chat(serving, request, prefix="resp")
    response_id = "resp_" + chat.run.request_id.rsplit("-", 1)[-1]
    conversation = history + _input_messages(body.input)
    if body.stream:
        events = _events(serving, store, chat, body, response_id, conversation)
        return event_stream(chat.run, events, raw_request, error_event=_error_event, done=None)
    (final,) = await serving.run_to_end(chat.run, raw_request)
    choice = final.outputs[0]
    message, _ = chat.plan.message(choice.text)
    output = [_item(block, _item_id(_ITEM_PREFIXES[block.kind])) for block in message_blocks(message)]
    status = "incomplete" if _incomplete(choice) else "completed"
    response = _response(body, response_id, chat.run.created, chat.run.model, status, output, chat.run, final)
    if body.store:
        store.put(response, conversation + _output_messages(output))
    return response


def _error_payload(error: APIError) -> dict[str, Any]:
    """The fields of the Responses API's ``error`` event (``code`` is a string there)."""
    body = error_body(error.status, error.message, error.kind, error.param)["error"]
    return {
        "code": str(body["code"]) if body.get("code") is not None else None,
        "message": body["message"],
        "param": body.get("param"),
    }


def _error_event(error: APIError) -> str:
    """An error outside the event sequence (the stream never started its events)."""
    payload = {"type": "error", **_error_payload(error), "sequence_number": 0}
    return f"event: error\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _events(
    serving: Serving,
    store: ResponseStore,
    chat: ChatRun,
    body: ResponsesRequest,
    response_id: str,
    conversation: list[dict[str, Any]],
) -> AsyncGenerator[str, None]:
    run = chat.run
    sequence = 0

    def event(kind: str, **payload: Any) -> str:
        nonlocal sequence
        sequence += 1
        data = {"type": kind, "sequence_number": sequence - 1, **payload}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def snapshot(status: str, output: list[dict[str, Any]], final: RequestOutput | None) -> dict[str, Any]:
        return _response(body, response_id, run.created, run.model, status, output, run, final)

    yield event("response.created", response=snapshot("in_progress", [], None))
    yield event("response.in_progress", response=snapshot("in_progress", [], None))
    try:
        async for line in _output_events(serving, store, chat, body, conversation, event, snapshot):
            yield line
    except APIError as error:  # the engine failed the request: say so in the stream's own events
        yield event("error", **_error_payload(error))
        failed = snapshot("failed", [], None)
        failed["error"] = {
            "code": "server_error" if error.status >= 500 else "invalid_prompt",
            "message": error.message,
        }
        yield event("response.failed", response=failed)


async def _output_events(
    serving: Serving,
    store: ResponseStore,
    chat: ChatRun,
    body: ResponsesRequest,
    conversation: list[dict[str, Any]],
    event: Any,
    snapshot: Any,
) -> AsyncGenerator[str, None]:
    item_ids: dict[int, str] = {}
    done_items: list[dict[str, Any]] = []
    choice_blocks = ChoiceBlocks(serving, chat)
    async for kind, block, piece in choice_blocks.events():
        for line in _block_events(event, kind, block, piece, item_ids, done_items):
            yield line
    final = check_finished(choice_blocks.final)
    status = "incomplete" if _incomplete(final.outputs[0]) else "completed"
    response = snapshot(status, done_items, final)
    if body.store:
        store.put(response, conversation + _output_messages(done_items))
    yield event("response.incomplete" if status == "incomplete" else "response.completed", response=response)


def _block_events(
    event: Any, kind: str, block: Block, piece: str, item_ids: dict[int, str], done_items: list[dict[str, Any]]
) -> list[str]:
    """The Responses events of one block event (`BlockStream`)."""
    if kind == "start":
        item_id = item_ids[block.index] = _item_id(_ITEM_PREFIXES[block.kind])
        lines = [
            event("response.output_item.added", output_index=block.index, item=_item(block, item_id, "in_progress"))
        ]
        if block.kind != "tool":  # a message's text or a reasoning item's text: one content part
            lines.append(
                event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=block.index,
                    content_index=0,
                    part=_part(block.kind, ""),
                )
            )
        return lines
    item_id = item_ids[block.index]
    where = {"item_id": item_id, "output_index": block.index}
    if kind == "delta":
        if block.kind == "tool":
            return [event("response.function_call_arguments.delta", delta=piece, **where)]
        if block.kind == "thinking":
            return [event("response.reasoning_text.delta", content_index=0, delta=piece, **where)]
        return [event("response.output_text.delta", content_index=0, delta=piece, logprobs=[], **where)]
    item = _item(block, item_id)
    done_items.append(item)
    if block.kind == "tool":
        lines = [event("response.function_call_arguments.done", arguments=block.text, name=block.name, **where)]
    else:
        if block.kind == "thinking":
            lines = [event("response.reasoning_text.done", content_index=0, text=block.text, **where)]
        else:
            lines = [event("response.output_text.done", content_index=0, text=block.text, logprobs=[], **where)]
        lines.append(event("response.content_part.done", content_index=0, part=_part(block.kind, block.text), **where))
    lines.append(event("response.output_item.done", output_index=block.index, item=item))
    return lines


def get_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


def delete_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    if not store.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
