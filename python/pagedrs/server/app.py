"""The FastAPI application: routes, errors in OpenAI's format, API key, one log line per
request."""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedrs import __version__
from pagedrs.engine.async_engine import AsyncLLMEngine, DrainingError, EngineDeadError, QueueFullError
from pagedrs.envinfo import environment, model_fingerprint
from pagedrs.server.chat import create_chat_completion, render_chat
from pagedrs.server.completions import create_completion
from pagedrs.server.messages import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    count_tokens,
    create_message,
)
from pagedrs.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedrs.server.pooling import create_embedding, create_rerank, create_score
from pagedrs.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagedrs.server.responses import (
    ResponsesRequest,
    ResponseStore,
    create_response,
    delete_response,
    get_response,
)
from pagedrs.server.serving import (
    APIError,
    ClientDisconnected,
    Serving,
    ToolSettings,
    error_body,
    warn_unknown_fields,
)
from pagedrs.server.settings import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
from pagedrs.spec_decode import SpeculativeConfig

logger = logging.getLogger("pagedrs.server")

_QUIET_PATHS = ("/metrics", "/health")


ANTHROPIC_PATHS = "/v1/messages"
"""Routes of Anthropic's API: their errors are Anthropic's objects, their key may come in
``x-api-key``."""


KEYED_PATHS = ("/v1/", "/v2/", "/score", "/rerank")
"""Routes that need the API key when the server has one: the model's API under ``/v1`` and
``/v2``, and vLLM's unversioned aliases of score and rerank."""


QUEUED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/score",
        "/score",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/v1/messages",
        "/v1/responses",
    }
)
"""Routes whose POST queues work for the engine: refused before their body is read while the
waiting queue is full or the server drains (`AccessMiddleware`)."""

RETRY_AFTER = {"overloaded": "1", "draining": "5"}
"""Seconds a refused client is told to wait (``Retry-After``)."""


def _needs_key(path: str) -> bool:
    return path.startswith(KEYED_PATHS) or path == "/v1"


def _error(status: int, message: str, kind: str, param: str | None = None, path: str = "") -> JSONResponse:
    """An error response in the shape of the API ``path`` belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    return JSONResponse(error_body(status, message, kind, param), status_code=status)


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        if item.get("type") == "json_invalid":
            return (
                f"malformed JSON body: {item.get('ctx', {}).get('error', 'invalid JSON')} at position {item['loc'][-1]}"
            )
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        parts.append(f"{location}: {item.get('msg')}" if location else str(item.get("msg")))
    return "; ".join(parts) or "invalid request body"


_ERROR_TYPES = {404: "NotFoundError", 413: "RequestTooLargeError"}


def _too_large(max_bytes: int) -> str:
    return f"the request body is larger than the server's limit of {max_bytes} bytes (--max-request-bytes)"


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413: at once when ``Content-Length``
    says so, else as soon as the body read so far passes the limit (a chunked upload)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                response = _error(413, _too_large(self.max_bytes), _ERROR_TYPES[413], path=scope["path"])
                await response(scope, receive, send)
                return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while reading the body through.
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, counted_receive, send)


def _refused(status: int, message: str, path: str, retry_after: str) -> JSONResponse:
    """An overload (503; Anthropic's 529) or shutdown refusal, with ``Retry-After``."""
    if path.startswith(ANTHROPIC_PATHS) and status == 503:
        status = 529  # Anthropic's "overloaded"
    response = _error(status, message, "ServiceUnavailableError", path=path)
    response.headers["Retry-After"] = retry_after
    return response


class AccessMiddleware:
    """Checks the API key on ``/v1`` routes, refuses work the engine cannot take before its
    body is read (a full waiting queue, a draining server: `QUEUED_PATHS`), logs one line per
    request when its response has been sent (for a stream, when the stream ends), and counts
    requests per route."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        metrics: ServerMetrics | None = None,
        engine: AsyncLLMEngine | None = None,
    ):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.engine = engine

    def _refusal(self, scope) -> JSONResponse | None:
        """The answer to a request the engine cannot take now, before its body is read (the
        cheapest answer the server gives); ``None`` to go on."""
        engine, path = self.engine, scope["path"]
        if engine is None or scope["method"] != "POST" or path not in QUEUED_PATHS:
            return None
        if engine.draining:
            return _refused(503, "the server is shutting down and takes no new requests", path, RETRY_AFTER["draining"])
        limit = engine.max_waiting_requests
        if limit is not None and (waiting := engine.num_waiting()) >= limit:
            message = f"the server is overloaded: {waiting} requests are waiting (limit {limit}); retry later"
            return _refused(503, message, path, RETRY_AFTER["overloaded"])
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0
        refused = False  # before routing: counted under its path (one of QUEUED_PATHS)

        async def send_logged(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            path = scope["path"]
            if self.api_key is not None and _needs_key(path) and not self._authorized(scope):
                header = (
                    "x-api-key: <key>' or 'Authorization: Bearer <key>" if path.startswith(ANTHROPIC_PATHS) else None
                )
                response = _error(
                    401,
                    f"invalid or missing API key (send '{header or 'Authorization: Bearer <key>'}')",
                    "AuthenticationError",
                    path=path,
                )
                await response(scope, receive, send_logged)
            elif (refusal := self._refusal(scope)) is not None:
                refused = True
                await refusal(scope, receive, send_logged)
            else:
                await self.app(scope, receive, send_logged)
        finally:
            route = getattr(scope.get("route"), "path", None) or (scope["path"] if refused else None)
            if self.metrics is not None and route is not None:
                self.metrics.record_api_request(route, status)
            # /metrics and /health are scraped and probed every few seconds: no line each.
            if not (scope["path"] in _QUIET_PATHS and status == 200):
                client = scope.get("client") or ("-", 0)
                state = scope.get("state") or {}
                logger.info(
                    '%s:%s "%s %s" %s %.3fs%s',
                    client[0],
                    client[1],
                    scope["method"],
                    scope["path"],
                    status or "disconnected",
                    time.monotonic() - start,
                    state.get("log_extra", ""),
                )

    def _authorized(self, scope) -> bool:
        assert self.api_key is not None
        anthropic = scope["path"].startswith(ANTHROPIC_PATHS)
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), self.api_key):
                    return True
            elif name == b"x-api-key" and anthropic:  # the Anthropic SDK's header
                if hmac.compare_digest(value.decode("latin-1").strip(), self.api_key):
                    return True
        return False


def build_app(
    engine: AsyncLLMEngine,
    *,
    served_model_name: str,
    metrics: ServerMetrics,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_settings: ToolSettings | None = None,
    server_config: ServerConfig | None = None,
) -> Any:
    """The ASGI application serving `engine` (started by the caller); ``server_config``, when
    given, is reported by ``/server_info``."""
    serving = Serving(engine, served_model_name, tool_settings)
    for name, path in (server_config.lora_paths if server_config is not None else {}).items():
        try:
            serving.add_adapter(name, path)
        except APIError as error:  # a bad --lora-modules entry stops the start
            raise ValueError(f"--lora-modules {name}={path}: {error.message}") from None
    app = FastAPI(title="pagedrs", version=__version__)
    app.state.serving = serving
    max_stored = server_config.max_stored_responses if server_config is not None else 1024
    store = ResponseStore(max_responses=max_stored)
    app.state.responses = store

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return _error(error.status, error.message, error.kind, error.param, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        return _error(400, _validation_message(error), "BadRequestError", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kind = _ERROR_TYPES.get(error.status_code, "BadRequestError")
        return _error(error.status_code, str(error.detail), kind, path=request.url.path)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, error: QueueFullError):
        # (most are refused before their body is read: these came in while the queue filled)
        if isinstance(error, DrainingError):
            return _refused(503, str(error), request.url.path, RETRY_AFTER["draining"])
        message = f"the server is overloaded: {error}; retry later"
        return _refused(503, message, request.url.path, RETRY_AFTER["overloaded"])

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError):
        return _error(503, str(error), "ServiceUnavailableError", path=request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, error: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception):
        logger.exception("unhandled error")
        return _error(500, f"{type(error).__name__}: {error}", "InternalServerError", path=request.url.path)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        return await create_completion(serving, body, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(serving, body, raw_request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw_request: Request):
        return await create_embedding(serving, body, raw_request)

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: ScoreRequest, raw_request: Request):
        return await create_score(serving, body, raw_request)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw_request: Request):
        return await create_rerank(serving, body, raw_request)

    @app.post("/v1/messages")
    async def anthropic_messages(body: MessagesRequest, raw_request: Request):
        return await create_message(serving, body, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: CountTokensRequest):
        return await count_tokens(serving, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw_request: Request):
        return await create_response(serving, store, body, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def read_response(response_id: str):
        return get_response(store, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str):
        return delete_response(store, response_id)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        base = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "pagedrs",
            "root": engine.info.model_name,
            "parent": None,
            "max_model_len": serving.max_model_len,
        }
        adapters = [
            base | {"id": name, "root": str(request.lora_path), "parent": served_model_name}
            for name, request in serving.adapters.items()
        ]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        warn_unknown_fields(body)
        await serving.load_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        warn_unknown_fields(body)
        serving.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health():
        if not engine.is_alive():
            return _error(503, "the engine has stopped", "ServiceUnavailableError")
        if engine.draining:  # load balancers stop sending at once
            return _refused(503, "the server is shutting down", "/health", RETRY_AFTER["draining"])
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/server_info")
    async def server_info():
        """What a benchmark record needs to say what was measured: every engine setting
        (`EngineConfig.to_dict`), then what they resolved to."""
        info = engine.info
        return {
            **info.config.to_dict(),
            "engine": "pagedrs",
            "served_model_name": served_model_name,
            "model": info.model_name,
            "model_fingerprint": model_fingerprint(info.model_name),
            "architecture": info.architecture,
            "dtype": str(info.dtype).removeprefix("torch."),
            "device": str(info.device),
            "num_kv_blocks": engine.stats.num_blocks,
            "max_model_len": info.max_model_len,
            "distributed_backend": info.distributed_backend,
            "speculative_config": _speculative_info(info.speculative),
            "server_config": _public_server_config(server_config),
            "environment": environment(),
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages")
        if body.messages is not None:
            conversation = [message.for_template() for message in body.messages]
            tokens = await serving.tokenize(render_chat, conversation, body.add_generation_prompt)
        else:
            tokens = await serving.tokenize(
                lambda tokenizer, text: tokenizer.encode(text, add_special_tokens=body.add_special_tokens), body.prompt
            )
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        vocab = len(serving.tokenizer)
        if any(not 0 <= token < vocab for token in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await serving.tokenize(lambda tokenizer, tokens: tokenizer.decode(tokens), body.tokens)}

    return AccessMiddleware(BodyLimitMiddleware(app, max_request_bytes), api_key, metrics, engine)


def _speculative_info(speculative: SpeculativeConfig | None) -> dict[str, Any] | None:
    """The speculative config in effect: defaults filled in (0: never steps aside)."""
    if speculative is None:
        return None
    low, high = speculative.lookup_range()
    return {
        **dataclasses.asdict(speculative),
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
        "disable_by_batch_size": speculative.disable_by_batch_size or 0,
    }


def _public_server_config(config: ServerConfig | None) -> dict[str, Any] | None:
    """The server's settings, the API key left out (only whether one is required)."""
    if config is None:
        return None
    settings = dataclasses.asdict(config)
    settings["api_key"] = "required" if config.api_key else None
    return settings
