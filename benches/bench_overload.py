"""What an operator measures on a real `pagedrs serve` process on loopback (issue: production
behaviour), side by side in one run:

1. **Overload refusals**: bursts of 200 requests at once against ``--max-waiting-requests 8``
   (``--max-num-seqs 2``), from one asyncio client on raw sockets: the latency of the 503s,
   p50 and p99, per burst (the first burst hits a server that has served one request).
2. **A 20 MB body**: 4.4 million token ids posted to ``/v1/completions`` while a thread polls
   ``GET /health`` every 20 ms: the worst wait (the body is refused as too long).
3. **Drain**: 8 streams of 48 tokens, SIGTERM once each has its first token: how many complete,
   and the seconds from the last stream's end to the process's exit.

    .venv/bin/python benches/bench_overload.py [--bursts 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedrs.kernels.cpu import native_isa
from tests.helpers.servers import send_raw, start_server, start_streams

BODY = {"prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True}


def raw_request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _one(port: int, request: bytes) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(request)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    await reader.read()
    writer.close()
    return status, time.monotonic() - start


def burst(port: int, size: int) -> dict:
    request = raw_request("/v1/completions", json.dumps(BODY).encode())

    async def all_at_once():
        return await asyncio.gather(*(_one(port, request) for _ in range(size)))

    answers = asyncio.run(all_at_once())
    refused = sorted(seconds for status, seconds in answers if status == 503)
    return {
        "refused": len(refused),
        "p50_ms": round(statistics.median(refused) * 1e3, 1),
        "p99_ms": round(refused[min(len(refused) - 1, int(0.99 * len(refused)))] * 1e3, 1),
    }


def health_beside_a_huge_body(port: int) -> dict:
    payload = json.dumps({"prompt": [2 + i % 300 for i in range(4_400_000)], "max_tokens": 1}).encode()
    done, waits = threading.Event(), []

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            send_raw(port, "GET", "/health")
            waits.append(time.monotonic() - start)
            done.wait(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    start = time.monotonic()
    status, _ = send_raw(port, "POST", "/v1/completions", payload)
    seconds = time.monotonic() - start
    done.set()
    poller.join()
    return {"body_mb": round(len(payload) / 1e6, 1), "status": status, "request_s": round(seconds, 2),
            "worst_health_wait_ms": round(max(waits) * 1e3), "polls": len(waits)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = [args.model] if args.model else []
    record: dict = {"cpu": platform.processor() or platform.machine(), "isa": native_isa()}
    with tempfile.TemporaryDirectory() as directory:
        server = start_server([*model, "--max-num-seqs", "2", "--max-waiting-requests", "8"], f"{directory}/a.log")
        try:
            asyncio.run(_one(server.port, raw_request("/v1/completions", json.dumps(BODY).encode())))
            record["bursts"] = []
            for _ in range(args.bursts):
                record["bursts"].append(burst(server.port, 200))
                time.sleep(3)
            record["huge_body"] = health_beside_a_huge_body(server.port)
        finally:
            server.stop()
        server = start_server([*model, "--max-num-seqs", "8"], f"{directory}/b.log")
        try:
            pool, futures = start_streams(server.port, 8, max_tokens=48)
            server.process.send_signal(signal.SIGTERM)
            results = [future.result(timeout=300) for future in futures]
            last = time.monotonic()
            code = server.process.wait(60)
            record["drain"] = {
                "completed": sum(r["finish"] == "length" and r["chunks"] == 48 for r in results),
                "streams": len(results),
                "exit_code": code,
                "exit_after_last_stream_s": round(time.monotonic() - last, 2),
            }
            pool.shutdown()
        finally:
            server.stop()
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
