"""`ServerConfig`: the HTTP server's own knobs (the engine's are `pagedrs.config.EngineConfig`),
declared once; ``pagedrs serve``'s flags derive from both (`pagedrs.cli_args`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

from pagedrs.config import check_fields, knob
from pagedrs.server.reasoning import REASONING_PARSERS
from pagedrs.server.tool_parsers import TOOL_PARSERS

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20

LogLevel = Literal["debug", "info", "warning", "error"]
RouterPolicy = Literal["cache_aware", "round_robin", "least_load"]


@dataclass
class ServerConfig:
    """What ``pagedrs serve`` adds to the engine: address, names, limits, tools."""

    host: str = knob("127.0.0.1", "address to bind (default: loopback only)", group="server")
    port: int = knob(8000, "port to bind", group="server", minimum=0)
    served_model_name: str | None = knob(
        None,
        "the model name clients send (default: the model argument, or SmolLM2-135M-Instruct)",
        group="server",
    )
    api_key: str | None = knob(
        None,
        "require 'Authorization: Bearer KEY' on the API's routes (/v1, /v2, /score, /rerank; /v1/messages also "
        "takes x-api-key) (default: $PAGEDRS_API_KEY)",
        group="server",
    )
    max_waiting_requests: int = knob(
        512, "answer 503 to new requests while this many wait (0: no limit)", group="server", minimum=0
    )
    shutdown_timeout: float = knob(
        30.0,
        "on SIGTERM or Ctrl-C: stop taking requests, let those in flight finish for at most this many "
        "seconds, then abort the rest and exit (a second signal exits at once; 0: abort at once)",
        group="server",
        minimum=0,
    )
    max_request_bytes: int = knob(
        DEFAULT_MAX_REQUEST_BYTES, "answer 413 to request bodies larger than this (default: 32 MiB)", group="server"
    )
    max_stored_responses: int = knob(
        1024,
        "responses /v1/responses keeps for previous_response_id and GET (least recently used dropped first; "
        "also at most 64 MiB of them); 0: store none",
        group="server",
        minimum=0,
    )
    lora_modules: list | None = knob(
        None,
        'LoRA adapters served from the start, as NAME=PATH (or vLLM\'s JSON {"name": ..., "path": ...}); '
        "a request selects one with model: NAME (needs --enable-lora; docs/lora.md)",
        group="server",
    )
    log_level: LogLevel = knob("info", "log level", group="server")
    data_parallel_size: int = knob(
        1,
        "engine replicas, each its own process with a share of the CPU cores (or its own GPUs), behind one "
        "HTTP front: the pagedrs-router, routing by prefix affinity (docs/router.md)",
        group="data_parallel",
        flags=("-dp",),
        minimum=1,
    )
    router_policy: RouterPolicy = knob(
        "cache_aware",
        "how the front picks a replica (with --data-parallel-size > 1): cache_aware (prefix affinity, load as "
        "the tie-breaker), round_robin or least_load",
        group="data_parallel",
    )
    enable_auto_tool_choice: bool = knob(
        False,
        'let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
        group="tools",
    )
    tool_call_parser: str | None = knob(
        None,
        "how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json, mistral",
        group="tools",
        choices=tuple(sorted(TOOL_PARSERS)),
    )
    reasoning_parser: str | None = knob(
        None,
        "split <think>...</think> into the message's reasoning_content",
        group="tools",
        choices=tuple(sorted(REASONING_PARSERS)),
    )

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("PAGEDRS_API_KEY")
        check_fields(self)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.lora_paths = _lora_paths(self.lora_modules or [])
        """``--lora-modules`` as name -> path."""

    def served_name(self, model: str | None) -> str:
        """The name clients send for ``model`` (the engine's ``model`` setting)."""
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_SERVED_NAME if model is None else model


def _lora_paths(modules: list) -> dict[str, str]:
    paths: dict[str, str] = {}
    for module in modules:
        if isinstance(module, str) and module.lstrip().startswith("{"):
            try:
                module = json.loads(module)
            except json.JSONDecodeError as error:
                raise ValueError(f"lora_modules: {module!r} is not JSON: {error}") from None
        if isinstance(module, dict):
            name, path = module.get("name"), module.get("path")
        elif isinstance(module, str) and "=" in module:
            name, path = module.split("=", 1)
        else:
            name = path = None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f'lora_modules entries are NAME=PATH or {{"name": ..., "path": ...}}, got {module!r}')
        if name in paths:
            raise ValueError(f"lora_modules names {name!r} twice")
        paths[name] = path
    return paths
