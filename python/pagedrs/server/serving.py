"""What completions and chat completions share: validation, sampling parameters, running
several engine requests as one API request, usage, and errors in OpenAI's format."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from pagedrs.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream, add_delta
from pagedrs.lora.adapter import LoRARequest, load_adapter
from pagedrs.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams, StructuredOutputsParams
from pagedrs.server.protocol import _Generation
from pagedrs.server.reasoning import ReasoningParser
from pagedrs.server.tool_stream import ToolParser

logger = logging.getLogger("pagedrs.server")


class APIError(Exception):
    """An error the client gets as an OpenAI error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# Finish reasons the OpenAI API knows; the KV cache running out ends a request like a length
# limit does.
_FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length", "abort": "abort"}


def finish_reason(choice: CompletionOutput) -> str | None:
    return None if choice.finish_reason is None else _FINISH_REASONS.get(choice.finish_reason, choice.finish_reason)


def finite(logprob: float) -> float:
    """JSON has no -inf; OpenAI clients expect a number (vLLM sends -9999.0 too)."""
    return logprob if math.isfinite(logprob) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None


def prompts_of(tokenizer: Any, prompt: Any, param: str = "prompt") -> list[Prompt]:
    """A request's prompts (text, texts, token ids or lists of them: OpenAI's ``prompt`` and
    ``input``) as token ids (on a tokenizer thread: `Serving.tokenize`)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, f"{param} must not be empty", param=param)
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(Prompt(tokenizer.encode(item), item))
        else:
            prompts.append(Prompt(list(item)))
        if not prompts[-1].token_ids:
            raise APIError(400, f"{param} must not be empty", param=param)
    return prompts


@dataclass
class ChoiceCursor:
    """What has been streamed of one choice so far."""

    text: int = 0
    tokens: int = 0
    done: bool = False
    started: bool = False


@dataclass
class Run:
    """One API request: an engine request per prompt, each with ``n`` choices."""

    request_id: str
    created: int
    model: str
    n: int
    prompts: list[Prompt]
    streams: list[RequestStream] = field(default_factory=list)
    finals: list[RequestOutput | None] = field(default_factory=list)
    lora: LoRARequest | None = None
    """The adapter the request's ``model`` names, if it names one (``model`` is then its name)."""

    def choice_index(self, prompt_index: int, choice_index: int) -> int:
        return prompt_index * self.n + choice_index

    def usage(self) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for final in self.finals if final for c in final.outputs)
        cached = sum(final.num_cached_tokens for final in self.finals if final)
        return usage(sum(len(p.token_ids) for p in self.prompts), completion, cached)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


@dataclass
class ToolSettings:
    """The server's tool flags (``--enable-auto-tool-choice``, ``--tool-call-parser``,
    ``--reasoning-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None


class Serving:
    """Turns API requests into engine requests."""

    TOKENIZER_THREADS = 4
    """Prompts are tokenized on this many threads, off the event loop: a prompt of many
    megabytes takes seconds, and /health and every other client must not wait for it."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        tool_settings: ToolSettings | None = None,
    ):
        self.engine = engine
        self.tool_settings = tool_settings or ToolSettings()
        self.served_model_name = served_model_name
        self.max_model_len = engine.info.max_model_len
        self.scheduling_policy = engine.info.config.scheduling_policy
        # NOTE: a fast tokenizer refuses concurrent use from two threads, so each thread has
        # its own copy: the engine thread's, the event loop's (`tokenizer`: decoding single
        # tokens for streams and logprobs), and one per tokenizer thread.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self._tokenizer_pool = ThreadPoolExecutor(self.TOKENIZER_THREADS, thread_name_prefix="pagedrs-tokenizer")
        self.adapters: dict[str, LoRARequest] = {}
        """LoRA adapters served by name (``--lora-modules``, ``/v1/load_lora_adapter``)."""
        self._lora_ids = itertools.count(1)
        self._thread_tokenizers = threading.local()

    def _thread_tokenizer(self) -> Any:
        tokenizer = getattr(self._thread_tokenizers, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._thread_tokenizers.tokenizer = copy.deepcopy(self.engine.tokenizer)
        return tokenizer

    async def tokenize(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(tokenizer, *args)`` on a tokenizer thread, with that thread's tokenizer."""

        def call() -> Any:
            return work(self._thread_tokenizer(), *args)

        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, call)

    # -- checks --------------------------------------------------------------------------

    def check_model(self, model: str | None, adapters: bool = True) -> None:
        """``model`` is the served model or (where ``adapters``) a loaded LoRA adapter's name."""
        if model is not None and model in self.adapters:
            if not adapters:
                raise APIError(400, f"`{model}` is a LoRA adapter: this route runs the base model only", param="model")
            return
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def check_length(self, prompt: Prompt, max_tokens: int | None, prompt_word: str = "prompt") -> int:
        """The request's max_tokens, after checking prompt and output fit in max_model_len."""
        room = self.max_model_len - len(prompt.token_ids)
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{prompt_word} has {len(prompt.token_ids)} tokens; leave room for at least one generated token.",
                param="messages" if prompt_word == "messages" else "prompt",
            )
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt.token_ids) + max_tokens} tokens ({len(prompt.token_ids)} in the {prompt_word}, "
                f"{max_tokens} in the completion). Please reduce the length of the {prompt_word} or completion.",
                param="max_tokens",
            )
        return max_tokens

    def sampling_params(self, body: _Generation, max_tokens: int | None, **extra: Any) -> SamplingParams:
        warn_unknown_fields(body)
        if body.priority != 0 and self.scheduling_policy != "priority":
            raise APIError(400, "priority needs the server started with --scheduling-policy priority", param="priority")
        max_num_seqs = self.engine.info.config.max_num_seqs
        if body.n > max_num_seqs:
            raise APIError(400, f"n must be at most max_num_seqs ({max_num_seqs})", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if "structured_outputs" not in extra:
            extra["structured_outputs"] = structured_outputs(body)
        try:
            return SamplingParams(
                n=body.n,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=body.seed,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                **extra,
            )
        except ValueError as error:
            raise APIError(400, str(error)) from error

    # -- running -------------------------------------------------------------------------

    def new_run(self, prefix: str, n: int, prompts: list[Prompt], model: str | None = None) -> Run:
        """``model``: the request's, when it may name a LoRA adapter (resolved now: an adapter
        unloaded later does not change what this request runs)."""
        lora = self.adapters.get(model) if model is not None else None
        name = model if lora is not None and model is not None else self.served_model_name
        return Run(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), name, n, prompts, lora=lora)

    # -- LoRA adapters ---------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Serves the peft adapter at ``path`` as model ``name``; it is read and checked
        against the model on a worker thread first."""
        await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self.add_adapter, name, path)

    def add_adapter(self, name: str, path: str) -> None:
        """`load_adapter`'s work, on the calling thread (``--lora-modules`` at start)."""
        config = self.engine.info.config
        if not config.enable_lora:
            raise APIError(400, "the server was started without --enable-lora", param="lora_name")
        if not isinstance(name, str) or not name or name == self.served_model_name or name in self.adapters:
            raise APIError(400, f"the model name {name!r} is taken (or empty)", param="lora_name")
        if not isinstance(path, str) or not path:
            raise APIError(400, "lora_path must be a non-empty string", param="lora_path")
        request = LoRARequest(name, next(self._lora_ids), path)
        try:
            # Reads the model's shapes only (the engine thread may be stepping meanwhile).
            load_adapter(request, self.engine.engine.model, config.max_lora_rank)
        except ValueError as error:
            raise APIError(400, str(error), param="lora_path") from error
        self.adapters[name] = request

    def unload_adapter(self, name: str) -> None:
        """Stops serving adapter ``name`` (requests already running finish with it)."""
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", "NotFoundError", "lora_name")

    def check_count(self, count: int, param: str) -> None:
        """Refuses a request of more prompts than the server queues at once, before any of
        them is tokenized."""
        limit = self.engine.max_waiting_requests
        if limit is not None and count > limit:
            raise APIError(
                400,
                f"this request has {count} prompts; the server queues at most {limit} at a time "
                "(--max-waiting-requests): send them in smaller requests",
                param=param,
            )

    async def start(
        self,
        run: Run,
        params: Sequence[SamplingParams | PoolingParams],
        body: _Generation | None = None,
    ) -> None:
        """Queues one engine request per prompt (all in the same engine step); if one is
        refused, none stays queued. ``body``: its priority and cache salt, when it has them."""
        priority = body.priority if body is not None else 0
        cache_salt = body.cache_salt if body is not None else None
        self.check_count(len(run.prompts), "prompt")
        results = await asyncio.gather(
            *(
                self.engine.add_request(
                    f"{run.request_id}-{index}",
                    prompt.token_ids,
                    param,
                    priority=priority,
                    cache_salt=cache_salt,
                    delta=True,
                    lora_request=run.lora,
                )
                for index, (prompt, param) in enumerate(zip(run.prompts, params))
            ),
            return_exceptions=True,
        )
        run.streams = [result for result in results if not isinstance(result, BaseException)]
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            run.abort()
            if isinstance(errors[0], ValueError):
                raise APIError(400, str(errors[0])) from errors[0]
            raise errors[0]
        run.finals = [None] * len(run.streams)

    async def outputs(self, run: Run) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, cumulative output)`` from all of the run's requests as they come.

        NOTE: the streams hand over deltas, added up here into ``run.finals`` in place: the
        output yielded is the same object each time, grown (readers keep cursors into it), so
        no step copies a stream's whole output."""
        if len(run.streams) == 1:
            async for delta in run.streams[0]:
                output = run.finals[0] = add_delta(run.finals[0], delta)
                yield 0, output
            return
        merged: asyncio.Queue = asyncio.Queue()
        ended = object()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    await merged.put((index, output))
            except Exception as error:  # noqa: BLE001 - re-raised by the reader below
                await merged.put((index, error))
            await merged.put((index, ended))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(run.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await merged.get()
                if item is ended:
                    remaining -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                output = run.finals[index] = add_delta(run.finals[index], item)
                yield index, output
        finally:
            for task in tasks:
                task.cancel()

    async def run_to_end(self, run: Run, raw_request: Request) -> list[RequestOutput]:
        """Waits for every request of the run to finish, aborting them all if the client
        disconnects first."""

        async def consume() -> None:
            async for _ in self.outputs(run):
                pass

        work = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(wait_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
            run.abort()  # a no-op for requests that finished
        if work not in done:
            logger.info("%s: the client disconnected; its requests were aborted", run.request_id)
            raise ClientDisconnected(run.request_id)
        log_usage(raw_request, run.request_id, run.usage(), run.finals)
        work.result()  # raises what the engine raised
        finals = []
        for final in run.finals:
            ended = check_finished(final)
            check_failed(ended)
            finals.append(ended)
        return finals


def structured_outputs(body: _Generation) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever of the names users know it gives:
    OpenAI's ``response_format``, vLLM's ``structured_outputs`` or its ``guided_*`` fields."""
    given: list[tuple[str, dict[str, Any]]] = []
    format_ = body.response_format
    if format_ is not None and format_.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif format_ is not None and format_.type == "json_schema":
        if format_.json_schema is None or format_.json_schema.json_schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        given.append(("response_format", {"json": format_.json_schema.json_schema}))
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        given.append(("structured_outputs", fields))
    guided = {
        "json": body.guided_json,
        "regex": body.guided_regex,
        "choice": body.guided_choice,
        "grammar": body.guided_grammar,
    }
    for name, value in guided.items():
        if value is not None:
            given.append((f"guided_{name}", {name: value}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"give one output constraint, not several ({names})", param=given[1][0])
    name, fields = given[0]
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as error:
        raise APIError(400, str(error), param=name) from error


def log_usage(
    raw_request: Request, request_id: str, counts: dict[str, Any], finals: list[RequestOutput | None]
) -> None:
    """Adds the request's id, token counts and finish reasons to its access log line."""
    reasons = ",".join(str(finish_reason(c)) for final in finals if final for c in final.outputs) or "none"
    raw_request.state.log_extra = (
        f" {request_id} prompt={counts['prompt_tokens']} completion={counts['completion_tokens']} finish={reasons}"
    )


def warn_unknown_fields(body: BaseModel) -> None:
    """Bodies take fields they do not know (clients send newer APIs' fields); each is logged."""
    if body.model_extra:
        logger.warning("ignoring unknown request fields: %s", ", ".join(sorted(body.model_extra)))


def check_finished(final: RequestOutput | None) -> RequestOutput:
    """``final``, the last output of a request, if the request finished (not aborted)."""
    if final is None or not final.finished:
        raise APIError(500, "the request ended without finishing (aborted)", "InternalServerError")
    return final


def check_failed(output: RequestOutput) -> None:
    if output.error is not None:
        raise APIError(500, f"the request failed in the engine: {output.error}", "InternalServerError")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def openai_error_event(error: APIError) -> str:
    return sse(error_body(error.status, error.message, error.kind, error.param))


def event_stream(
    run: Run,
    events: AsyncGenerator[str, None],
    raw_request: Request,
    *,
    error_event: Callable[[APIError], str] = openai_error_event,
    done: str | None = "data: [DONE]\n\n",
) -> StreamingResponse:
    """Server-sent events, then ``done`` (OpenAI's ``data: [DONE]``). A failure after the
    stream has started is sent as ``error_event`` (the API's error event); however the stream
    ends, the run is aborted."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except APIError as error:
            yield error_event(error)
        except EngineDeadError as error:  # a shutdown's deadline, or the engine died: say which
            yield error_event(APIError(503, str(error), "ServiceUnavailableError"))
        except Exception as error:  # the status line has gone: say it in the stream
            logger.exception("%s: the stream failed", run.request_id)
            yield error_event(APIError(500, f"{type(error).__name__}: {error}", "InternalServerError"))
        finally:
            run.abort()
            log_usage(raw_request, run.request_id, run.usage(), run.finals)
        if done is not None:
            yield done

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def top_entries(entry: dict[int, Logprob], count: int) -> list[tuple[int, Logprob]]:
    """The ``count`` most likely tokens of a position, best first."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(token, logprob) for token, logprob in ranked if logprob.rank <= count][:count]
