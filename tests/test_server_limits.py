"""The server's limits and failures, on a tiny random-weight Llama (it starts in seconds):
the API key, 503 when the waiting queue is full, a request that fails inside the engine."""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server_process import Server, free_port, start_server, wait_for


def test_api_key_from_the_environment(tiny_llama, tmp_path):
    server = start_server([tiny_llama, "--device", "cpu"], str(tmp_path / "log"), env={"PAGEDRS_API_KEY": "s3cret"})
    try:
        body = {"prompt": "w5 w6 w7", "max_tokens": 3}
        assert server.request("POST", "/v1/completions", body)[0] == 401
        status, error = server.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401 and error["error"]["code"] == 401
        ok = {"Authorization": "Bearer s3cret"}
        status, out = server.request("POST", "/v1/completions", body, headers=ok)
        assert status == 200 and out["usage"]["completion_tokens"] == 3
        # Health and metrics stay open (load balancers and Prometheus have no key).
        assert server.request("GET", "/health")[0] == 200
        assert server.request("GET", "/metrics")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="s3cret", max_retries=0)
        assert client.models.list().data[0].id == tiny_llama
    finally:
        server.stop()


class InProcessServer:
    """The real app under uvicorn on a thread, so a test can reach into its engine."""

    def __init__(self, argv: list[str]):
        import uvicorn
        from pagedrs.server.launch import add_serve_arguments, build_server

        args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
        self.app, self.engine = build_server(args)
        self.port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.uvicorn.started, timeout=30)
        self.http = Server(process=None, port=self.port, log_path="")

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


def test_full_waiting_queue_gets_503_fast(tiny_llama):
    server = InProcessServer([tiny_llama, "--device", "cpu", "--max-waiting-requests", "2"])
    gate = threading.Event()
    step = server.engine.engine.step

    def gated_step():
        gate.wait()
        return step()

    try:
        body = {"prompt": "w5 w6 w7", "max_tokens": 4}
        assert server.http.request("POST", "/v1/completions", body)[0] == 200
        server.engine.engine.step = gated_step
        with ThreadPoolExecutor(3) as pool:
            # The first request holds the engine in its (gated) step; two more wait.
            first = pool.submit(server.http.request, "POST", "/v1/completions", body)
            assert wait_for(lambda: server.engine.engine.has_unfinished_requests())
            waiting = [pool.submit(server.http.request, "POST", "/v1/completions", body) for _ in range(2)]
            assert wait_for(lambda: server.engine.num_waiting() == 2)
            start = time.monotonic()
            status, error = server.http.request("POST", "/v1/completions", body)
            assert status == 503 and error["error"]["code"] == 503
            assert time.monotonic() - start < 2.0
            gate.set()
            assert [f.result()[0] for f in [first, *waiting]] == [200, 200, 200]
        assert server.http.request("POST", "/v1/completions", body)[0] == 200
        assert wait_for(lambda: server.engine.stats.num_used_blocks == 0)
    finally:
        gate.set()
        server.close()


def test_a_request_failing_in_the_engine_fails_alone(tiny_llama):
    server = InProcessServer([tiny_llama, "--device", "cpu"])
    engine = server.engine.engine
    append = engine._append
    poison = engine.tokenizer.encode("w13")[0]

    def append_or_fail(request, choice, token, *args, **kwargs):
        if poison in request.prompt_token_ids and len(choice.output.token_ids) == 2:
            raise RuntimeError("injected failure")
        return append(request, choice, token, *args, **kwargs)

    engine._append = append_or_fail
    try:
        good = {"prompt": "w5 w6 w7", "max_tokens": 8, "ignore_eos": True}
        bad = {"prompt": "w13 w6 w7", "max_tokens": 8, "ignore_eos": True}
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(server.http.request, "POST", "/v1/completions", b) for b in [good, bad, good, good]]
            stream = pool.submit(server.http.request, "POST", "/v1/completions", {**bad, "stream": True})
            results = [f.result() for f in futures]
            streamed = stream.result()
        assert [status for status, _ in results] == [200, 500, 200, 200]
        assert "injected failure" in results[1][1]["error"]["message"]
        assert all(body["usage"]["completion_tokens"] == 8 for status, body in results if status == 200)
        # A stream that has started reports the failure in the stream, then ends.
        assert streamed[0] == 200 and "injected failure" in streamed[1] and streamed[1].endswith("data: [DONE]\n\n")
        assert wait_for(lambda: server.engine.stats.num_used_blocks == 0)
        assert server.http.request("POST", "/v1/completions", good)[0] == 200
    finally:
        server.close()
