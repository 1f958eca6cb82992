"""The OpenAI-compatible server, run as a real process on loopback with the default model and
driven by the official `openai` client (raw HTTP for the error cases)."""

from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest

from tests.helpers.servers import start_server, wait_for

pytestmark = pytest.mark.slow  # one server process on the default model, shared by the module

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = start_server(["--kv-cache-memory", "256MiB", "--max-model-len", "2048"], str(log))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_models_health_version(server, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert server.request("GET", "/health")[0] == 200
    status, body = server.request("GET", "/version")
    assert status == 200 and body["version"]


def test_server_info_reports_every_setting_and_what_it_resolved_to(server):
    import dataclasses

    from pagedrs.config import EngineConfig

    status, info = server.request("GET", "/server_info")
    assert status == 200
    assert {spec.name for spec in dataclasses.fields(EngineConfig)} <= set(info)
    assert info["kv_cache_memory"] == "256MiB" and info["max_model_len"] == 2048
    assert info["dtype"] == "float32" and info["num_kv_blocks"] > 0
    assert info["server_config"]["api_key"] is None and info["server_config"]["port"] == server.port


def test_completion_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert "Paris" in whole.choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.id == chunks[0].id for chunk in chunks)


def test_chat_streaming_equals_non_streaming_with_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and "Paris" in text
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    streamed_usage = chunks[-1].usage
    assert (streamed_usage.prompt_tokens, streamed_usage.completion_tokens, streamed_usage.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_usage_counts_match_the_tokenizer(server, client):
    status, tokenized = server.request("POST", "/tokenize", {"prompt": "Once upon a time"})
    assert status == 200 and tokenized["count"] == len(tokenized["tokens"])
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0)
    assert out.usage.prompt_tokens == tokenized["count"]
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == tokenized["count"] + 7
    # A token-id prompt is the same prompt.
    same = client.completions.create(model=MODEL, prompt=tokenized["tokens"], max_tokens=7, temperature=0)
    assert same.choices[0].text == out.choices[0].text
    status, detok = server.request("POST", "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200 and detok["prompt"] == "Once upon a time"
    status, chat = server.request("POST", "/tokenize", {"messages": QUESTION})
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    assert reply.usage.prompt_tokens == chat["count"]


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(client):
    # 40 words of its own (no other test's prompt shares its first block), asked twice.
    prompt = "Cached prefix check: " + " ".join(f"w{i}" for i in range(40))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every whole block of the prompt but the one holding its last token (block size 16).
    assert cached == (first.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_n_choices_and_several_prompts(client):
    out = client.completions.create(model=MODEL, prompt="Write a word:", n=2, max_tokens=8, temperature=1.0, seed=3)
    assert sorted(choice.index for choice in out.choices) == [0, 1]
    assert out.usage.completion_tokens == sum(8 for _ in out.choices)
    many = client.completions.create(model=MODEL, prompt=["One", "Two", "Three"], n=2, max_tokens=4, temperature=0)
    assert sorted(choice.index for choice in many.choices) == list(range(6))
    # Greedy choices of one prompt agree; each prompt gets its own text.
    texts = {choice.index: choice.text for choice in many.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[4] == texts[5]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=6, temperature=0.9, seed=5)
    assert sorted(choice.index for choice in chat.choices) == [0, 1]


def test_stop_strings_and_length(client):
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
    assert "," in whole.choices[0].text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[","])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and "," not in choice.text
    assert whole.choices[0].text.startswith(choice.text)
    # Streaming never shows text that a stop string later takes back.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[", 7"], stream=True
        )
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    reference = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[", 7"])
    assert streamed == reference.choices[0].text and ", 7" not in streamed
    short = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == 4 == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == out.choices[0].text
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the sampled token is the best
    echoed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    assert echoed.choices[0].text.startswith("The capital of France is")
    assert echoed.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has none
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and "".join(item.token for item in content) == chat.choices[0].message.content
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token for item in content)


def test_seed_reproducible(client):
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16, temperature=1.0
    )
    first = client.chat.completions.create(**kwargs, seed=42).choices[0].message.content
    second = client.chat.completions.create(**kwargs, seed=42).choices[0].message.content
    other = client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    assert first == second
    assert other != first


def _raw(server, body=None, raw=None, path="/v1/completions"):
    return server.request("POST", path, body, raw=raw)


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client):
    cases = [
        (_raw(server, raw=b'{"prompt": "x",'), 400),  # malformed JSON
        (_raw(server, {"prompt": "x", "max_tokens": "5"}), 400),  # wrong type
        (_raw(server, {"prompt": 5}), 400),
        (_raw(server, {"prompt": "x", "temperature": -1}), 400),  # out of range
        (_raw(server, {"prompt": "x", "top_p": 1.5}), 400),
        (_raw(server, {"prompt": "x", "n": 0}), 400),
        (_raw(server, {"prompt": "x", "max_tokens": 0}), 400),
        (_raw(server, {"prompt": "x", "logprobs": 50}), 400),
        (_raw(server, {"prompt": [999999]}), 400),  # token id outside the vocabulary
        (_raw(server, {"prompt": []}), 400),
        (_raw(server, {"prompt": "x", "priority": 3}), 400),  # fcfs server
        (_raw(server, {"prompt": "x", "model": "gpt-4"}), 404),  # unknown model
        (_raw(server, {"prompt": list(range(2048))}), 400),  # longer than max_model_len
        (_raw(server, {"prompt": "x", "max_tokens": 4000}), 400),  # prompt + output too long
        (_raw(server, {"messages": []}, path="/v1/chat/completions"), 400),
        (_raw(server, {"messages": QUESTION, "top_logprobs": 2}, path="/v1/chat/completions"), 400),
    ]
    for (status, body), expected in cases:
        assert status == expected, body
        assert set(body["error"]) >= {"message", "type", "code"} and body["error"]["code"] == expected
    status, body = _raw(server, {"prompt": list(range(2048))})
    assert "maximum context length is 2048" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    # Unknown fields are ignored, as OpenAI and vLLM do.
    status, body = _raw(server, {"prompt": "x", "max_tokens": 2, "frobnicate": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert wait_for(lambda: server.metrics()["pagedrs:kv_cache_used_blocks"] == 0)
    assert server.request("GET", "/health")[0] == 200


def _open_request(server, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(server, stream):
    body = {
        "prompt": "Count to one thousand: 1, 2, 3,",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    before = server.metrics()
    sock = _open_request(server, body)
    if stream:
        received = b""
        while b"data: " not in received:  # tokens are flowing
            received += sock.recv(4096)
    else:
        assert wait_for(lambda: server.metrics()["pagedrs:num_requests_running"] == 1)
    assert server.metrics()["pagedrs:kv_cache_used_blocks"] > 0
    sock.close()
    # Aborted within an iteration or two: nothing running, no block in use.
    assert wait_for(lambda: server.metrics()["pagedrs:kv_cache_used_blocks"] == 0, timeout=5)
    after = server.metrics()
    assert after["pagedrs:num_requests_running"] == 0 and after["pagedrs:num_requests_waiting"] == 0
    generated = after["pagedrs:generation_tokens_total"] - before["pagedrs:generation_tokens_total"]
    assert generated < 1000


def test_metrics_page(server, client):
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    status, text = server.request("GET", "/metrics")
    assert status == 200
    for name in [
        "pagedrs:num_requests_running",
        "pagedrs:num_requests_waiting",
        "pagedrs:kv_cache_usage_perc",
        "pagedrs:kv_cache_cached_free_blocks",
        "pagedrs:prefix_cache_queries_total",
        "pagedrs:prefix_cache_hits_total",
        "pagedrs:num_preemptions_total",
        "pagedrs:prompt_tokens_total",
        "pagedrs:generation_tokens_total",
        "pagedrs:time_to_first_token_seconds_bucket",
        "pagedrs:inter_token_latency_seconds_bucket",
        "pagedrs:e2e_request_latency_seconds_bucket",
        "pagedrs:iteration_tokens_total_bucket",
        "pagedrs:request_success_total",
    ]:
        assert f"\n{name}" in text, name
    values = server.metrics()
    assert values["pagedrs:prefix_cache_queries_total"] >= values["pagedrs:prefix_cache_hits_total"] > 0
    assert values["pagedrs:kv_cache_cached_free_blocks"] > 0  # the finished prompts stay cached
    assert values["pagedrs:kv_cache_usage_perc"] == 0.0  # ... but count as free


def test_32_concurrent_streams(client, server):
    prompts = ["The sea is", "My favourite food is", "In the morning I", "The best city is"]
    expected = {
        prompt: client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        for prompt in prompts
    }
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_of_them() -> list[str]:
        try:
            return await asyncio.gather(*(one(prompts[i % 4]) for i in range(32)))
        finally:
            await aclient.close()

    texts = asyncio.run(all_of_them())
    assert texts == [expected[prompts[i % 4]] for i in range(32)]
    assert wait_for(lambda: server.metrics()["pagedrs:kv_cache_used_blocks"] == 0)


def test_one_log_line_per_request(server, client):
    client.completions.create(model=MODEL, prompt="Log me", max_tokens=2, temperature=0)
    lines = [line for line in server.log().splitlines() if '"POST /v1/completions" 200' in line]
    assert lines and "prompt=" in lines[-1] and "completion=2" in lines[-1]


def test_the_default_model_answers_a_json_schema_request_with_valid_json(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["capital", "country"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    answer = json.loads(reply.choices[0].message.content)
    jsonschema.validate(answer, schema)
