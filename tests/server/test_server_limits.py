"""The server's limits and failures, on a tiny random-weight Llama (it starts in seconds):
the API key, 503 when the waiting queue is full, a request that fails inside the engine."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.helpers.servers import InProcessServer, start_server, wait_for


@pytest.mark.slow  # a server process
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


def test_full_waiting_queue_gets_503(tiny_llama):
    server = InProcessServer([tiny_llama, "--device", "cpu", "--max-waiting-requests", "2"])
    gate = threading.Event()
    step = server.engine.engine.step
    num_steps = itertools.count()

    def gated_step():
        if next(num_steps) > 0:  # the first step schedules the first request, then the gate
            gate.wait()
        return step()

    try:
        body = {"prompt": "w5 w6 w7", "max_tokens": 4, "ignore_eos": True}
        assert server.http.request("POST", "/v1/completions", body)[0] == 200
        server.engine.engine.step = gated_step
        with ThreadPoolExecutor(3) as pool:
            # The first request runs, holding the engine in its second (gated) step; two more wait.
            first = pool.submit(server.http.request, "POST", "/v1/completions", body)
            assert wait_for(lambda: server.engine.stats.num_running == 1)
            waiting = [pool.submit(server.http.request, "POST", "/v1/completions", body) for _ in range(2)]
            assert wait_for(lambda: server.engine.num_waiting() == 2)
            status, error = server.http.request("POST", "/v1/completions", body)
            assert status == 503 and error["error"]["code"] == 503
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
    processor = engine.processor
    append = processor._append
    poison = engine.tokenizer.encode("w13")[0]

    def append_or_fail(request, choice, token, *args, **kwargs):
        if poison in request.prompt_token_ids and len(choice.output.token_ids) == 2:
            raise RuntimeError("injected failure")
        return append(request, choice, token, *args, **kwargs)

    processor._append = append_or_fail
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
