"""``pagedrs serve``: flags (vLLM's names where they mean the same), engine start-up, uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from pagedrs.config import EngineConfig
    from pagedrs.engine.async_engine import AsyncLLMEngine
    from pagedrs.server.settings import ServerConfig


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``pagedrs serve``'s flags: every `ServerConfig` and `EngineConfig` field."""
    from pagedrs.cli_args import add_config_arguments
    from pagedrs.config import EngineConfig
    from pagedrs.server.settings import ServerConfig

    add_config_arguments(parser, ServerConfig)
    return add_config_arguments(parser, EngineConfig)


def configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's configs the flags describe; a bad value exits with a
    usage message (status 2), before anything loads."""
    from pagedrs.cli_args import config_from_args
    from pagedrs.config import EngineConfig
    from pagedrs.server.settings import ServerConfig

    try:
        return config_from_args(EngineConfig, args), config_from_args(ServerConfig, args)
    except ValueError as error:
        print(f"pagedrs serve: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def build_server(args: argparse.Namespace, start_engine_thread: bool = True):
    """Loads the model and returns ``(app, async engine)``. Without ``start_engine_thread``
    the caller runs the engine loop (`AsyncLLMEngine.run`)."""
    from pagedrs.engine.async_engine import AsyncLLMEngine
    from pagedrs.engine.llm_engine import LLMEngine
    from pagedrs.server.app import build_app
    from pagedrs.server.metrics import ServerMetrics
    from pagedrs.server.reasoning import get_reasoning_parser
    from pagedrs.server.serving import ToolSettings
    from pagedrs.server.tool_parsers import get_tool_parser

    config, server = configs(args)
    tool_settings = ToolSettings(
        enable_auto_tool_choice=server.enable_auto_tool_choice,
        tool_parser=get_tool_parser(server.tool_call_parser)() if server.tool_call_parser else None,
        reasoning_parser=get_reasoning_parser(server.reasoning_parser)() if server.reasoning_parser else None,
    )
    name = server.served_name(config.model)
    metrics = ServerMetrics(name)
    engine = AsyncLLMEngine(
        LLMEngine(config),
        max_waiting_requests=server.max_waiting_requests or None,
        stat_logger=metrics,
        start_thread=start_engine_thread,
    )
    metrics.attach(engine)
    try:
        app = build_app(
            engine,
            served_model_name=name,
            metrics=metrics,
            api_key=server.api_key,
            max_request_bytes=server.max_request_bytes,
            tool_settings=tool_settings,
            server_config=server,
        )
    except BaseException:  # (a bad --lora-modules entry): no engine thread left behind
        engine.shutdown()
        raise
    return app, engine


def serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM or Ctrl-C (exit status 0), or until the engine dies (1).
    A headless node (``--node-rank`` > 0) or a non-zero rank started by torchrun serves its
    tensor-parallel ranks instead, until node 0 stops them."""
    import uvicorn

    config, server_config = configs(args)
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if server_config.data_parallel_size > 1:
        from pagedrs.server.data_parallel import serve_data_parallel

        return serve_data_parallel(args, config, server_config)
    headless = _serve_other_ranks(config)
    if headless is not None:
        return headless
    app, engine = build_server(args, start_engine_thread=False)
    logging.getLogger("pagedrs.server").info(
        "serving %s on http://%s:%d (API key %s)",
        server_config.served_name(config.model),
        server_config.host,
        server_config.port,
        "required" if server_config.api_key else "off",
    )
    # HTTP on a background thread, the engine loop on this (main) thread: see async_engine.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.log_level,
            access_log=False,
        )
    )
    http = threading.Thread(target=server.run, name="pagedrs-http", daemon=True)
    http.start()
    _stop_on_signals(engine, server_config.shutdown_timeout)
    try:
        engine.run(until=lambda: not http.is_alive())  # also ends if the server could not start
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(10)
        engine.engine.shutdown()  # the ranks and threads of the engine itself
    code = 0 if server.started else 1
    if not engine.is_alive() and engine.dead_reason is not None:
        logging.getLogger("pagedrs.server").error("exiting: %s", engine.dead_reason)
        code = 1
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """Ends the process once the server and the engine have stopped. The interpreter's own
    teardown (torch's and the kernels' destructors) took 1.4 s after the last stream and does
    nothing a stopped server needs: a rolling restart should not wait for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop_on_signals(engine: AsyncLLMEngine, shutdown_timeout: float) -> None:
    """SIGTERM or SIGINT (Ctrl-C): drain (``/health`` says 503, new requests get 503 with
    ``Retry-After``, those in flight finish within ``shutdown_timeout`` seconds), then exit 0;
    a second signal stops at once."""
    log = logging.getLogger("pagedrs.server")
    received: list[int] = []

    def on_signal(number: int, _frame: Any) -> None:
        received.append(number)
        name = signal.Signals(number).name
        if len(received) == 1:
            log.info(
                "%s: draining (requests in flight get %gs to finish; a second signal stops now)", name, shutdown_timeout
            )
            engine.drain(shutdown_timeout)
        else:
            log.info("%s again: stopping now", name)
            engine.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _serve_other_ranks(config: EngineConfig) -> int | None:
    """Runs this process's tensor-parallel ranks when it is not rank 0 (a headless node, or a
    rank torchrun started); ``None`` for rank 0, which serves."""
    from pagedrs.engine.tp_common import launched_setup
    from pagedrs.engine.tp_worker import run_node, run_worker

    device = config.torch_device()
    launched = launched_setup(config, device)
    if launched is not None:
        return None if launched.rank == 0 else run_worker(launched)
    if config.node_rank != 0:
        return run_node(config, device)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_arguments(argparse.ArgumentParser(prog="pagedrs serve", description="OpenAI-compatible server"))
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
