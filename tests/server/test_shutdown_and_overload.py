"""What an operator meets on a real server over loopback (raw HTTP): SIGTERM drains (``/health``
503 at once, new requests 503 with ``Retry-After``, every stream in flight completes, exit 0),
``--shutdown-timeout`` bounds the drain (the rest end with an error event), a second signal stops
at once, a full queue is refused before the body is read, a request with n = max_num_seqs does
not starve a small one (``--max-seqs-per-request``), and an engine that dies mid-step is loud
(streams end with an error event, ``/health`` 503, the process exits non-zero)."""

from __future__ import annotations

import http.client
import json
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.servers import (
    STREAM_BODY,
    InProcessServer,
    engine_idle,
    free_port,
    send_raw,
    start_server,
    start_streams,
    stream,
    wait_for,
)

pytestmark = pytest.mark.slow  # server processes


def test_sigterm_drains_every_stream_in_flight_then_exits_0(tmp_path):
    server = start_server(["--max-num-seqs", "8"], str(tmp_path / "server.log"))
    pool, futures = start_streams(server.port, 8, max_tokens=48)
    try:
        server.process.send_signal(signal.SIGTERM)
        # (Python runs the handler on the engine's thread between two steps: within one step)
        assert wait_for(lambda: server.request("GET", "/health")[0] == 503, timeout=5, interval=0.01)
        refused = send_raw(
            server.port, "POST", "/v1/completions", json.dumps({**STREAM_BODY, "max_tokens": 2}).encode()
        )
        assert refused[0] == 503 and "shutting down" in refused[1]["error"]["message"]
        results = [future.result(timeout=120) for future in futures]
        last_stream = time.monotonic()
        assert all(r["status"] == 200 and r["done"] and not r["errors"] for r in results), results
        assert all(r["finish"] == "length" and r["chunks"] == 48 for r in results), results
        assert server.process.wait(30) == 0
        print(f"exited {time.monotonic() - last_stream:.2f} s after the last stream ended")
        assert "draining" in server.log()
    finally:
        pool.shutdown(wait=False)
        server.stop()


def test_the_shutdown_timeout_aborts_what_is_left_and_a_second_signal_stops_at_once(tmp_path):
    server = start_server(["--max-num-seqs", "4", "--shutdown-timeout", "1"], str(tmp_path / "server.log"))
    pool, futures = start_streams(server.port, 2, max_tokens=2000)
    try:
        server.process.send_signal(signal.SIGTERM)
        results = [future.result(timeout=60) for future in futures]
        for result in results:
            assert result["finish"] is None and result["done"]
            assert result["errors"] and "--shutdown-timeout" in result["errors"][0]["message"], result
        assert server.process.wait(30) == 0
    finally:
        pool.shutdown(wait=False)
        server.stop()

    server = start_server(["--max-num-seqs", "4"], str(tmp_path / "again.log"))
    pool, futures = start_streams(server.port, 2, max_tokens=2000)
    try:
        server.process.send_signal(signal.SIGTERM)
        # NOTE: two signals sent before Python runs the handler are one (POSIX merges a
        # pending signal): send the second once the first has been acted on, as an operator does.
        assert wait_for(lambda: server.request("GET", "/health")[0] == 503, timeout=10, interval=0.01)
        signal_time = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
        assert time.monotonic() - signal_time < 15
        assert all(result["errors"] for result in (future.result(timeout=60) for future in futures))
    finally:
        pool.shutdown(wait=False)
        server.stop()


def test_a_full_queue_is_refused_before_the_body_is_read_with_retry_after(tiny_llama):
    server = InProcessServer([tiny_llama, "--device", "cpu", "--max-waiting-requests", "4"])
    try:
        server.engine.num_waiting = lambda: 4  # the queue is full
        for path, body, status in [
            ("/v1/completions", b"{not json", 503),  # not parsed: the refusal comes first
            ("/v1/chat/completions", b"[]", 503),
            ("/v1/messages", b"{}", 529),  # Anthropic's "overloaded"
        ]:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = json.loads(response.read())
            assert response.status == status and response.getheader("Retry-After") == "1", payload
            assert "overloaded" in json.dumps(payload)
        # Routes that queue nothing still answer.
        assert server.http.request("POST", "/tokenize", {"prompt": "w5"})[0] == 200
        assert server.http.request("GET", "/health")[0] == 200
    finally:
        server.close()


def test_an_overload_burst_is_refused_fast(tmp_path):
    """200 requests at once against a queue of 8: the refusals' latency is reported (a
    benchmark's number, not a timed assert; see docs/benchmarks.md)."""
    server = start_server(["--max-num-seqs", "2", "--max-waiting-requests", "8"], str(tmp_path / "server.log"))
    body = json.dumps({**STREAM_BODY, "max_tokens": 16}).encode()

    def timed() -> tuple[int, float, str | None]:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        start = time.monotonic()
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status, time.monotonic() - start, response.getheader("Retry-After")

    try:
        with ThreadPoolExecutor(200) as pool:
            answers = list(pool.map(lambda _: timed(), range(200)))
        refused = sorted(seconds for status, seconds, _ in answers if status == 503)
        assert {status for status, _, _ in answers} <= {200, 503} and refused
        assert all(retry == "1" for status, _, retry in answers if status == 503)
        p99 = refused[min(len(refused) - 1, int(0.99 * len(refused)))]
        print(f"{len(refused)}/200 refused: p50 {statistics.median(refused) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
        assert wait_for(lambda: server.request("GET", "/metrics")[0] == 200)
    finally:
        server.stop()


@pytest.mark.parametrize("share", [2, 8])
def test_a_request_holding_every_seat_gives_a_small_one_its_share(tiny_llama, share):
    """n = 8 with --max-num-seqs 8 holds every seat. With --max-seqs-per-request 2 it gives six
    back when a small request arrives, which finishes while the wide one is still running; with
    a share of 8 (no share) the small one waits for all of it."""
    server = InProcessServer(
        [tiny_llama, "--device", "cpu", "--kv-cache-memory", "16MiB"]
        + ["--max-num-seqs", "8", "--max-seqs-per-request", str(share)]
    )
    wide_body = {**STREAM_BODY, "n": 8, "max_tokens": 400}
    small_body = {**STREAM_BODY, "max_tokens": 8}
    scheduler = server.engine.engine.scheduler
    try:
        with ThreadPoolExecutor(1) as pool:
            wide = pool.submit(server.http.request, "POST", "/v1/completions", wide_body)
            assert wait_for(lambda: scheduler.stats().num_running == 8, timeout=60, interval=0.01)
            status, small = server.http.request("POST", "/v1/completions", small_body)
            wide_done_first = wide.done()
            status_wide, wide_answer = wide.result(timeout=300)
        assert status == status_wide == 200
        assert small["usage"]["completion_tokens"] == 8
        assert [choice["finish_reason"] for choice in wide_answer["choices"]] == ["length"] * 8
        assert wide_answer["usage"]["completion_tokens"] == 8 * 400
        requeued = server.http.metrics()["pagedrs:num_fair_share_requeues_total"]
        if share == 2:
            assert not wide_done_first and requeued >= 6
        else:
            assert wide_done_first and requeued == 0
        assert wait_for(lambda: engine_idle(server))
    finally:
        server.close()


FAULTY = """
import sys
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.server.launch import main

step = LLMEngine.step
calls = [0]

def failing_step(self):
    calls[0] += 1
    if calls[0] > 5:
        raise RuntimeError("injected failure in the step")
    return step(self)

LLMEngine.step = failing_step
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_that_dies_is_loud_and_the_process_exits_non_zero(tmp_path):
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    process = subprocess.Popen([sys.executable, str(script), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: _health(port) == 200, timeout=240)
        result = stream(port, max_tokens=100)
        assert result["errors"] and "injected failure" in result["errors"][0]["message"], result
        assert process.wait(30) == 1
    finally:
        process.kill()
        log.close()
    assert "injected failure" in (tmp_path / "server.log").read_text()


def _health(port: int) -> int | None:
    try:
        return send_raw(port, "GET", "/health", timeout=5)[0]
    except OSError:
        return None
