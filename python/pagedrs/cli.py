"""The ``pagedrs`` command: ``serve``, ``router``, ``bench serve``, ``bench sweep``, ``bench plot``,
``memory``, ``models``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from pagedrs.bench.serve import add_bench_serve_arguments
    from pagedrs.bench.sweep import add_sweep_arguments
    from pagedrs.memory_cli import add_memory_arguments
    from pagedrs.server.launch import add_serve_arguments

    parser = argparse.ArgumentParser(prog="pagedrs", description="pagedrs: an LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(
        commands.add_parser(
            "serve",
            help="run the OpenAI-compatible server",
            description="Serve a model over an OpenAI-compatible HTTP API.",
        )
    )
    router = commands.add_parser(
        "router",
        help="route requests to OpenAI-compatible workers by prefix affinity (the Rust pagedrs-router)",
        description="pagedrs-router's own flags follow: pagedrs router --help lists them (docs/router.md).",
        add_help=False,
    )
    router.add_argument("router_args", nargs=argparse.REMAINDER)
    bench = commands.add_parser("bench", help="benchmarks against an OpenAI-compatible server")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_arguments(
        bench_commands.add_parser(
            "serve",
            help="one run of a workload preset, written as a JSON record",
            description="Load-generate against an OpenAI-compatible server and record what was measured.",
        )
    )
    add_sweep_arguments(
        bench_commands.add_parser(
            "sweep",
            help="a preset over concurrency levels, with plots",
            description="Run a preset at each concurrency level, write the records, draw the plots.",
        )
    )
    plot = bench_commands.add_parser("plot", help="draw the sweep plots from existing records")
    plot.add_argument("records", nargs="+")
    plot.add_argument("--out-dir", default="results/plots")
    add_memory_arguments(
        commands.add_parser(
            "memory",
            help="predict what a KV budget holds (and check it against a server)",
            description="KV bytes per token, blocks, capacity, fit and slack for a model, dtype and block size.",
        )
    )
    commands.add_parser(
        "models",
        help="list the model architectures pagedrs runs",
        description="The Hugging Face architectures pagedrs runs, their model_type and checkpoint formats.",
    )
    return parser


def print_models() -> None:
    from pagedrs.models.registry import supported_models

    rows = [("architecture", "model_type", "checkpoints"), *supported_models()]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:  # the Rust binary takes it from here, flags and all
        import os

        from pagedrs.server.data_parallel import router_binary

        binary = router_binary()
        os.execv(binary, [binary, *argv[1:]])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from pagedrs.server.launch import serve

        return serve(args)
    if args.command == "models":
        print_models()
        return 0
    if args.command == "memory":
        from pagedrs.memory_cli import main as memory_main

        return memory_main(args)
    if args.bench_command == "serve":
        from pagedrs.bench.serve import run

        run(args)
    elif args.bench_command == "sweep":
        from pagedrs.bench.sweep import sweep

        sweep(args)
    else:
        from pagedrs.bench.sweep import plot_files

        for path in plot_files(args.records, args.out_dir):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
