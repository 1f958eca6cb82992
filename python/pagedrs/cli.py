"""The ``pagedrs`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from pagedrs.server.launch import add_serve_arguments, serve

    parser = argparse.ArgumentParser(prog="pagedrs", description="pagedrs: an LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the OpenAI-compatible server",
                                            description="Serve a model over an OpenAI-compatible HTTP API."))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
