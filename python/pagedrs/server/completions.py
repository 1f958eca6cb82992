"""``POST /v1/completions``."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request

from pagedrs.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrs.server.protocol import CompletionRequest
from pagedrs.server.serving import (
    ChoiceCursor,
    Prompt,
    Run,
    Serving,
    check_failed,
    event_stream,
    finish_reason,
    finite,
    prompts_of,
    sse,
    top_entries,
)


class _Logprobs:
    """The legacy completions ``logprobs`` object, built a token at a time."""

    def __init__(self, serving: Serving, num_top: int, offset: int):
        self.serving, self.num_top, self.offset = serving, num_top, offset
        self.body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, token: int, entry: dict[int, Logprob] | None) -> None:
        piece = entry[token].decoded_token if entry and entry[token].decoded_token is not None else None
        if piece is None:
            piece = self.serving.tokenizer.decode([token])
        self.body["tokens"].append(piece)
        self.body["token_logprobs"].append(None if entry is None else finite(entry[token].logprob))
        self.body["top_logprobs"].append(
            None
            if entry is None
            else {(lp.decoded_token or ""): finite(lp.logprob) for _, lp in top_entries(entry, self.num_top)}
        )
        self.body["text_offset"].append(self.offset)
        self.offset += len(piece)


def _echo(serving: Serving, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else serving.tokenizer.decode(prompt.token_ids)


def _choice_logprobs(
    serving: Serving,
    body: CompletionRequest,
    prompt: Prompt,
    output: RequestOutput,
    choice: CompletionOutput,
    cursor: ChoiceCursor,
    echo: bool,
    offset: int,
) -> dict[str, list] | None:
    """Logprobs of the tokens past ``cursor`` (and of the prompt, when echoing it)."""
    if body.logprobs is None:
        return None
    logprobs = _Logprobs(serving, body.logprobs, offset)
    if echo:
        for token, entry in zip(prompt.token_ids, output.prompt_logprobs or [None] * len(prompt.token_ids)):
            logprobs.add(token, entry)
    for token, entry in zip(choice.token_ids[cursor.tokens :], (choice.logprobs or [])[cursor.tokens :]):
        logprobs.add(token, entry)
    return logprobs.body


async def create_completion(serving: Serving, body: CompletionRequest, raw_request: Request):
    serving.check_model(body.model)
    prompts = await serving.tokenize(prompts_of, body.prompt)
    max_tokens = [serving.check_length(prompt, body.max_tokens) for prompt in prompts]
    extra = {"logprobs": body.logprobs}
    if body.echo and body.logprobs is not None:
        extra["prompt_logprobs"] = body.logprobs
    # One validation (and one unknown-fields warning) per request; prompts differ only in
    # how many tokens they may still generate.
    base = serving.sampling_params(body, max_tokens[0], **extra)
    params = [base if limit == base.max_tokens else dataclasses.replace(base, max_tokens=limit) for limit in max_tokens]
    run = serving.new_run("cmpl", body.n, prompts, body.model)
    await serving.start(run, params, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(run, _events(serving, run, body, include_usage), raw_request)
    finals = await serving.run_to_end(run, raw_request)
    choices = []
    for prompt_index, (prompt, output) in enumerate(zip(prompts, finals)):
        for choice in output.outputs:
            echo = _echo(serving, prompt) if body.echo else ""
            choices.append(
                {
                    "index": run.choice_index(prompt_index, choice.index),
                    "text": echo + choice.text,
                    "logprobs": _choice_logprobs(serving, body, prompt, output, choice, ChoiceCursor(), body.echo, 0),
                    "finish_reason": finish_reason(choice),
                    "stop_reason": choice.stop_reason,
                }
            )
    return {
        "id": run.request_id,
        "object": "text_completion",
        "created": run.created,
        "model": run.model,
        "choices": choices,
        "usage": run.usage(),
    }


async def _events(
    serving: Serving, run: Run, body: CompletionRequest, include_usage: bool
) -> AsyncGenerator[str, None]:
    cursors: dict[tuple[int, int], ChoiceCursor] = {}

    def chunk(choices: list[dict[str, Any]], chunk_usage: dict[str, Any] | None = None) -> str:
        payload = {
            "id": run.request_id,
            "object": "text_completion",
            "created": run.created,
            "model": run.model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = chunk_usage
        return sse(payload)

    async for prompt_index, output in serving.outputs(run):
        check_failed(output)
        prompt = run.prompts[prompt_index]
        for choice in output.outputs:
            cursor = cursors.setdefault((prompt_index, choice.index), ChoiceCursor())
            if cursor.done:
                continue
            echo = body.echo and not cursor.started
            text = (_echo(serving, prompt) if echo else "") + choice.text[cursor.text :]
            new_tokens = len(choice.token_ids) > cursor.tokens
            reason = finish_reason(choice)
            if not text and reason is None and not (new_tokens and body.logprobs is not None):
                continue  # nothing to show yet (held back, or half a character)
            logprobs = _choice_logprobs(serving, body, prompt, output, choice, cursor, echo, cursor.text)
            cursor.text, cursor.tokens = len(choice.text), len(choice.token_ids)
            cursor.started, cursor.done = True, reason is not None
            yield chunk(
                [
                    {
                        "index": run.choice_index(prompt_index, choice.index),
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                        "stop_reason": choice.stop_reason if reason else None,
                    }
                ]
            )
    if include_usage:
        yield chunk([], run.usage())
