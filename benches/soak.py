"""Soak: minutes of abuse against a real `pagedrs serve` process on loopback, then what is
left. Not run in CI (tests/server/test_reliability.py asserts the same behaviour in seconds).

Rounds, in turn until the time is up: mixed valid and invalid requests; streams that the
client drops at random points (before the first byte, mid-body, mid-stream) or reads to the
end; client processes that open streams and get SIGKILL; overload bursts of 3x
``--max-waiting-requests`` long requests at once. Then rolling restarts (``--restarts``):
SIGTERM with 8 streams mid-generation, drain, exit, start again; no started stream may be
lost. Prints (and `main` returns) JSON figures:
requests by status, disconnects, 503 latency p50/p99, the server's RSS before and after, and
its KV blocks, running and waiting requests once everything has ended (all should be 0).

    .venv/bin/python benches/soak.py [--minutes 3] [--restarts 3] [--model PATH] [--device cpu] [--json soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.servers import STREAMING_CLIENT, Server, send_raw, start_server, stream_and_leave, wait_for

PROMPT = "w5 w6 w7 The capital of France is"  # words both the default model and tiny checkpoints tokenize
CHAT = [{"role": "user", "content": PROMPT}]

VALID = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": [PROMPT, "w8 w9"], "max_tokens": 4, "n": 2, "seed": 7, "temperature": 0.8}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 3, "echo": True, "unknown_field": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "top_p": 0.9, "top_k": 20, "min_p": 0.05}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 1e-30, "presence_penalty": 0.5}),
    ("/tokenize", {"prompt": PROMPT}),
]

# Raw bodies, so that NaN, lone surrogates and integers past 64 bits go over the wire as written.
INVALID = [
    ("/v1/completions", b'{"prompt": "w5", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "w5", "temperature": Infinity}'),
    ("/v1/completions", b'{"prompt": "w5", "top_p": 1e309}'),
    ("/v1/completions", b'{"prompt": "x\\ud800y"}'),
    ("/v1/completions", b'{"prompt": "w5", "seed": 18446744073709551616, "n": 2}'),
    ("/v1/completions", b'{"prompt": "w5", "stop_token_ids": [9223372036854775808]}'),
    ("/v1/completions", b'{"prompt": [-1, 5]}'),
    ("/v1/completions", b'{"prompt": "w5", "max_tokens": 0}'),
    ("/v1/completions", b'{"prompt": "w5", "model": "gpt-4"}'),
    ("/v1/completions", b'{"prompt": "w5",'),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w5"}], "n": 0}'),
    ("/tokenize", b'{"prompt": "x\\ud800y"}'),
    ("/detokenize", b'{"tokens": [18446744073709551616]}'),
]


class Tally:
    """What the rounds saw."""

    def __init__(self) -> None:
        self.by_status: Counter[str] = Counter()
        self.disconnects = 0
        self.killed_clients = 0
        self.latencies_503: list[float] = []
        self.stream_error_events = 0
        """Streams read to the end that carried an error event (the request failed after its start)."""
        self.server_errors: list[str] = []
        """The first few 5xx answers, to say what broke."""

    def record(self, status: int | str, answer: object = None) -> None:
        self.by_status[str(status)] += 1
        if isinstance(status, int) and status >= 500 and status != 503 and len(self.server_errors) < 10:
            self.server_errors.append(f"{status}: {str(answer)[:300]}")


def post(server: Server, path: str, body: bytes, tally: Tally) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        status, answer = send_raw(server.port, "POST", path, body, timeout=300)
    except (OSError, AssertionError) as error:
        tally.record(f"connection error ({type(error).__name__})")
        return 0, time.perf_counter() - start
    seconds = time.perf_counter() - start
    tally.record(status, answer)
    if status == 503:
        tally.latencies_503.append(seconds)
    return status, seconds


def mixed_round(server: Server, pool: ThreadPoolExecutor, rng: random.Random, tally: Tally) -> None:
    bodies = []
    for _ in range(48):
        if rng.random() < 0.5:
            path, body = rng.choice(VALID)
            bodies.append((path, json.dumps(body).encode()))
        else:
            bodies.append(rng.choice(INVALID))
    if rng.random() < 0.1:  # over the 32 MiB default body limit: whitespace around a valid body
        bodies.append(("/v1/completions", b'{"prompt": "w5", "max_tokens": 2' + b" " * (33 * 2**20) + b"}"))
    list(pool.map(lambda item: post(server, *item, tally), bodies))


async def _stream_and_leave(port: int, rng: random.Random, tally: Tally) -> None:
    behaviour = rng.choice(["before-first-byte", "mid-body", "mid-stream", "mid-stream", "to-the-end", "to-the-end"])
    path, body = rng.choice(VALID[:5])
    body = {**body, "stream": True, "max_tokens": rng.randint(8, 64), "ignore_eos": True}
    received = await stream_and_leave(
        port, path, body, behaviour, num_events=rng.randint(1, 6), reset=rng.random() < 0.5
    )
    if behaviour == "to-the-end":
        status = int(received[9:12]) if received.startswith(b"HTTP/1.1 ") else "no answer"
        tally.record(status, received[-300:])
        if b'data: {"error"' in received:
            tally.stream_error_events += 1
            if len(tally.server_errors) < 10:
                tally.server_errors.append(f"stream error event: {received[-300:].decode(errors='replace')}")
    else:
        tally.disconnects += 1
        tally.by_status["dropped by the client"] += 1


def streams_round(server: Server, rng: random.Random, tally: Tally, num_streams: int = 120) -> None:
    async def storm() -> None:
        slots = asyncio.Semaphore(24)

        async def one() -> None:
            async with slots:
                await _stream_and_leave(server.port, rng, tally)

        await asyncio.gather(*(one() for _ in range(num_streams)))

    asyncio.run(storm())


def sigkill_round(server: Server, rng: random.Random, tally: Tally) -> None:
    num_streams = rng.randint(2, 8)
    client = subprocess.Popen(
        [sys.executable, "-c", STREAMING_CLIENT, str(server.port), str(num_streams), "256"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        client.stdout.readline()  # "streaming" (or nothing, if the server refused them)
        time.sleep(rng.uniform(0, 0.5))
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    tally.killed_clients += 1
    tally.disconnects += num_streams
    tally.by_status["dropped by the client"] += num_streams


def burst_round(server: Server, pool: ThreadPoolExecutor, max_waiting: int, tally: Tally) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}).encode()
    list(pool.map(lambda _: post(server, "/v1/completions", body, tally), range(3 * max_waiting)))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)]


def rolling_restarts(flags: list[str], directory: Path, restarts: int, num_streams: int = 8) -> dict:
    """A rolling update's view of one replica: ``restarts`` times, a server with
    ``num_streams`` streams mid-generation gets SIGTERM, drains and exits, and a new one
    starts. A stream that had started streaming and did not get all its tokens is lost."""
    from tests.helpers.servers import start_streams

    lost, completed, exit_codes, exit_seconds = 0, 0, [], []
    for index in range(restarts):
        server = start_server([*flags, "--max-num-seqs", str(num_streams)], str(directory / f"restart-{index}.log"))
        try:
            pool, futures = start_streams(server.port, num_streams, max_tokens=48)
            server.process.send_signal(signal.SIGTERM)
            results = [future.result(timeout=300) for future in futures]
            last = time.monotonic()
            exit_codes.append(server.process.wait(120))
            exit_seconds.append(round(time.monotonic() - last, 2))
            pool.shutdown()
            done = sum(r["finish"] == "length" and r["chunks"] == 48 and not r["errors"] for r in results)
            completed += done
            lost += len(results) - done
        finally:
            server.stop()
    return {
        "restarts": restarts,
        "streams_completed": completed,
        "streams_lost": lost,
        "exit_codes": exit_codes,
        "exit_after_last_stream_s": exit_seconds,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--model", default=None, help="checkpoint directory or GGUF (default: the server's default)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=16, help="concurrent HTTP clients in mixed rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restarts", type=int, default=3, help="rolling restarts after the soak (SIGTERM under load)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    flags = [] if args.model is None else [args.model]
    flags += ["--max-waiting-requests", str(args.max_waiting_requests), "--kv-cache-memory", args.kv_cache_memory]
    flags += ["--max-model-len", str(args.max_model_len)] + ([] if args.device is None else ["--device", args.device])
    log = Path(tempfile.mkdtemp(prefix="pagedrs-soak-")) / "server.log"
    server = start_server(flags, str(log))
    rng, tally = random.Random(args.seed), Tally()
    try:
        warm_up = server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert warm_up[0] == 200, warm_up
        rss_before = rss_bytes(server.process.pid)
        start = time.monotonic()
        deadline = start + 60 * args.minutes
        rounds: Counter[str] = Counter()
        with ThreadPoolExecutor(max(args.workers, 3 * args.max_waiting_requests)) as pool:
            while time.monotonic() < deadline:
                kind = ["mixed", "streams", "sigkill", "burst"][sum(rounds.values()) % 4]
                if kind == "mixed":
                    mixed_round(server, pool, rng, tally)
                elif kind == "streams":
                    streams_round(server, rng, tally)
                elif kind == "sigkill":
                    sigkill_round(server, rng, tally)
                else:
                    burst_round(server, pool, args.max_waiting_requests, tally)
                rounds[kind] += 1
        seconds = time.monotonic() - start

        def idle() -> bool:
            values = server.metrics()
            return not any(
                values.get(f"pagedrs:{name}", 0) for name in ("num_requests_running", "num_requests_waiting")
            )

        drained = wait_for(idle, timeout=120, interval=0.5)
        # Freed blocks are only counted once a step has run: one small request, then read.
        after_request = server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        wait_for(idle, timeout=30, interval=0.5)
        values = server.metrics()
        rss_after = rss_bytes(server.process.pid)
    finally:
        server.stop()
    restarts = rolling_restarts(flags, log.parent, args.restarts)

    figures = {
        "model": args.model or "default",
        "minutes": round(seconds / 60, 2),
        "rounds": dict(rounds),
        "total_requests": sum(tally.by_status.values()),
        "by_status": dict(sorted(tally.by_status.items())),
        "disconnects": tally.disconnects,
        "killed_clients": tally.killed_clients,
        "stream_error_events": tally.stream_error_events,
        "latency_503_p50_s": percentile(tally.latencies_503, 0.5),
        "latency_503_p99_s": percentile(tally.latencies_503, 0.99),
        "server_rss_before_bytes": rss_before,
        "server_rss_after_bytes": rss_after,
        "drained": drained,
        "request_after_status": after_request[0],
        "used_blocks_after": values.get("pagedrs:kv_cache_used_blocks"),
        "running_after": values.get("pagedrs:num_requests_running"),
        "waiting_after": values.get("pagedrs:num_requests_waiting"),
        "server_errors": tally.server_errors,
        "rolling_restarts": restarts,
        "server_log": str(log),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
