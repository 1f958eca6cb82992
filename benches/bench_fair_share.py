"""A small request beside one that asks for every seat (issue: production behaviour, fair
share), on a real `pagedrs serve` process over loopback, side by side in one run:

1. the small request alone (``--small-tokens`` tokens, greedy and at temperature 1.0): the
   median of ``--repeats`` runs;
2. for each ``--max-seqs-per-request`` value: a wide request (``n = 64``, 256 tokens each,
   temperature 1.0, streamed) starts; once its choices are decoding (its first chunk, then
   ``--settle`` seconds), the small request is sent, timed, and the wide one is dropped (the
   server aborts it). Reported: the small request's time and its ratio to its time alone.

    .venv/bin/python benches/bench_fair_share.py [--shares 8,4,256] [--model PATH]

A share of ``--max-num-seqs`` (256 by default) or more is no share: the engine as it was.
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedrs.kernels.cpu import native_isa
from tests.helpers.servers import Server, start_server

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def timed_completion(server: Server, max_tokens: int, temperature: float) -> float:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": temperature, "seed": 1}
    start = time.monotonic()
    status, answer = server.request("POST", "/v1/completions", body)
    seconds = time.monotonic() - start
    assert status == 200 and answer["usage"]["completion_tokens"] == max_tokens, answer
    return seconds


def open_wide_stream(server: Server, n: int, max_tokens: int) -> http.client.HTTPConnection:
    """Starts the wide request and returns once its first chunk arrived (its prompt is done)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    body = {"prompt": PROMPT, "n": n, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "stream": True}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    while not response.readline().startswith(b"data: "):
        pass
    return connection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shares", default="8,4,256", help="--max-seqs-per-request values, comma-separated")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--wide-tokens", type=int, default=256)
    parser.add_argument("--small-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = [args.model] if args.model else []
    record: dict = {"cpu": platform.processor() or platform.machine(), "isa": native_isa(), "n": args.n,
                    "wide_tokens": args.wide_tokens, "small_tokens": args.small_tokens, "runs": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        for share in [int(value) for value in args.shares.split(",")]:
            server = start_server([*model, "--max-seqs-per-request", str(share)], f"{directory}/{share}.log")
            try:
                timed_completion(server, 4, 0.0)  # warm-up
                for temperature in (0.0, 1.0):
                    alone = statistics.median(
                        timed_completion(server, args.small_tokens, temperature) for _ in range(args.repeats)
                    )
                    beside = []
                    for _ in range(args.repeats):
                        wide = open_wide_stream(server, args.n, args.wide_tokens)
                        time.sleep(args.settle)
                        beside.append(timed_completion(server, args.small_tokens, temperature))
                        wide.close()
                        time.sleep(1.0)  # the abort lands
                    run = {
                        "max_seqs_per_request": share,
                        "small_temperature": temperature,
                        "alone_s": round(alone, 2),
                        "beside_wide_s": round(statistics.median(beside), 2),
                        "beside_wide_all_s": [round(seconds, 2) for seconds in beside],
                        "ratio": round(statistics.median(beside) / alone, 2),
                    }
                    record["runs"].append(run)
                    print(json.dumps(run), flush=True)
            finally:
                server.stop()
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
