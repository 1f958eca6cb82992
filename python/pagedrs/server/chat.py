"""``POST /v1/chat/completions``: the checkpoint's chat template, then a completion."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pagedrs.outputs import CompletionOutput, Logprob
from pagedrs.server.protocol import ChatCompletionRequest
from pagedrs.server.serving import (
    APIError,
    ChoiceCursor,
    Prompt,
    Run,
    Serving,
    check_failed,
    event_stream,
    finish_reason,
    finite,
    sse,
    structured_outputs,
    top_entries,
)
from pagedrs.server.tools import ToolPlan


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, str]],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the conversation (and the tools) under the checkpoint's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true")
    try:
        ids = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            tokenize=True,
        )
    except Exception as error:  # a template error is the request's fault
        raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from error
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _token_logprob(token_text: str, logprob: float) -> dict[str, Any]:
    return {"token": token_text, "logprob": finite(logprob), "bytes": list(token_text.encode("utf-8"))}


def _content_logprobs(serving: Serving, choice: CompletionOutput, start: int, num_top: int) -> list[dict[str, Any]]:
    entries: list[dict[int, Logprob]] = (choice.logprobs or [])[start:]
    content = []
    for token, entry in zip(choice.token_ids[start:], entries):
        text = entry[token].decoded_token
        if text is None:
            text = serving.tokenizer.decode([token])
        item = _token_logprob(text, entry[token].logprob)
        item["top_logprobs"] = [
            _token_logprob(lp.decoded_token or "", lp.logprob) for _, lp in top_entries(entry, num_top)
        ]
        content.append(item)
    return content


@dataclass
class ChatRun:
    """A chat request queued in the engine: its run, how it uses tools, what it echoes."""

    run: Run
    plan: ToolPlan
    echo: str
    num_top: int


async def start_chat(serving: Serving, body: ChatCompletionRequest, prefix: str = "chatcmpl") -> ChatRun:
    """Checks a chat request, renders its conversation and queues it (what chat completions,
    Anthropic's Messages and OpenAI's Responses share)."""
    serving.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    plan = ToolPlan.of(body, serving.tool_settings)
    conversation = body.conversation()
    token_ids = await serving.tokenize(
        render_chat, conversation, body.add_generation_prompt, body.continue_final_message, plan.tools
    )
    prompt = Prompt(token_ids)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = serving.check_length(prompt, requested, "messages")
    num_top = body.top_logprobs or 0
    extra: dict[str, Any] = {"logprobs": num_top if body.logprobs else None}
    if plan.constraint is not None:
        if structured_outputs(body) is not None:
            raise APIError(400, f"tool_choice {plan.mode} cannot be combined with another output constraint")
        extra["structured_outputs"] = plan.constraint
    if plan.parser is not None and plan.parser.needs_special_tokens:
        extra["skip_special_tokens"] = False  # its markers are special tokens
    params = serving.sampling_params(body, max_tokens, **extra)
    run = serving.new_run(prefix, body.n, [prompt], body.model)
    # vLLM's echo for chat: an unfinished assistant message is repeated before its continuation.
    echo = ""
    if body.echo and conversation and conversation[-1]["role"] == "assistant":
        echo = conversation[-1]["content"]
    await serving.start(run, [params], body)
    return ChatRun(run, plan, echo, num_top)


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest, raw_request: Request):
    chat = await start_chat(serving, body)
    run, plan, echo, num_top = chat.run, chat.plan, chat.echo, chat.num_top
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(run, _events(serving, run, body, plan, echo, num_top, include_usage), raw_request)
    (final,) = await serving.run_to_end(run, raw_request)
    choices = []
    for choice in final.outputs:
        message, called_tools = plan.message(echo + choice.text)
        choices.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": {"content": _content_logprobs(serving, choice, 0, num_top)} if body.logprobs else None,
                "finish_reason": "tool_calls" if called_tools else finish_reason(choice),
                "stop_reason": choice.stop_reason,
            }
        )
    return {
        "id": run.request_id,
        "object": "chat.completion",
        "created": run.created,
        "model": run.model,
        "choices": choices,
        "usage": run.usage(),
    }


async def _events(
    serving: Serving,
    run: Run,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    echo: str,
    num_top: int,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    cursors: dict[int, ChoiceCursor] = {}
    streams = [plan.stream() for _ in range(body.n)]

    def chunk(choices: list[dict[str, Any]], chunk_usage: dict[str, Any] | None = None) -> str:
        payload = {
            "id": run.request_id,
            "object": "chat.completion.chunk",
            "created": run.created,
            "model": run.model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = chunk_usage
        return sse(payload)

    # The first chunk of every choice carries the role, as OpenAI's do.
    yield chunk(
        [
            {"index": index, "delta": {"role": "assistant", "content": echo}, "logprobs": None, "finish_reason": None}
            for index in range(body.n)
        ]
    )
    async for _, output in serving.outputs(run):
        check_failed(output)
        for choice in output.outputs:
            cursor = cursors.setdefault(choice.index, ChoiceCursor())
            if cursor.done:
                continue
            text = choice.text[cursor.text :]
            new_tokens = len(choice.token_ids) > cursor.tokens
            reason = finish_reason(choice)
            if not text and reason is None and not (new_tokens and body.logprobs):
                continue  # nothing to show yet (held back, or half a character)
            logprobs = (
                {"content": _content_logprobs(serving, choice, cursor.tokens, num_top)} if body.logprobs else None
            )
            cursor.text, cursor.tokens, cursor.done = len(choice.text), len(choice.token_ids), reason is not None
            stream = streams[choice.index]
            deltas = stream.feed(text) if text else []
            if reason is not None:
                deltas += stream.finish()
                if stream.saw_tool_call:  # auto and required; a named call finishes with "stop"
                    reason = "tool_calls"
            if not deltas and reason is None and logprobs is None:
                continue  # held back by a parser (a marker may be starting)
            deltas = deltas or [{}]
            for number, delta in enumerate(deltas, start=1):
                last = number == len(deltas)
                yield chunk(
                    [
                        {
                            "index": choice.index,
                            "delta": delta,
                            "logprobs": logprobs if last else None,
                            "finish_reason": reason if last else None,
                            "stop_reason": choice.stop_reason if last and reason else None,
                        }
                    ]
                )
    if include_usage:
        yield chunk([], run.usage())
