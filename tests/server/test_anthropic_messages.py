"""Anthropic's Messages API on a real server, driven by the official `anthropic` client:
texts equal the greedy chat completion of the same conversation, streams carry Anthropic's
events, forced tool use gives ``tool_use`` blocks whose input fits the schema, tool results
go back through the chat template, ``count_tokens`` counts the rendered prompt, the key may
come in ``x-api-key``, and bad bodies are Anthropic error objects that leave the engine idle."""

from __future__ import annotations

import anthropic
import jsonschema
import openai
import pytest

from tests.helpers.servers import InProcessServer, engine_idle, wait_for
from tests.server.test_server_tools import PARAMETERS, WEATHER, tool_model  # noqa: F401 - a fixture

SYSTEM = "You answer briefly."
GREEDY = {"extra_body": {"temperature": 0}}
"""The client has no sampling arguments any more (Anthropic's newer models fix them); the API
still takes ``temperature``, ``top_p`` and ``top_k`` in the body."""
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def server(tool_model):  # noqa: F811 - the imported fixture
    server = InProcessServer(
        [tool_model, "--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "32MiB"]
        + ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(chat) -> str:
    return chat.models.list().data[0].id


def _greedy_chat(chat, model: str, messages: list[dict], max_tokens: int, **extra):
    return chat.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **extra)


def test_a_message_equals_the_greedy_chat_completion(client, chat, model, server):
    message = client.messages.create(model=model, max_tokens=24, system=SYSTEM, messages=ASK, **GREEDY)
    expected = _greedy_chat(chat, model, [{"role": "system", "content": SYSTEM}, *ASK], 24)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.choices[0].message.content
    reason = {"length": "max_tokens", "stop": "end_turn"}[expected.choices[0].finish_reason]
    assert message.stop_reason == reason and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == expected.usage.prompt_tokens
    assert usage.output_tokens == expected.usage.completion_tokens
    assert wait_for(lambda: engine_idle(server))


def test_a_stream_carries_anthropics_events_and_the_same_text(client, model):
    whole = client.messages.create(model=model, max_tokens=20, messages=ASK, **GREEDY)
    kinds = []
    with client.messages.stream(model=model, max_tokens=20, messages=ASK, **GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds and "content_block_stop" in kinds
    assert kinds[-2] == "message_delta"
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_message(client, model):
    whole = client.messages.create(model=model, max_tokens=24, messages=ASK, **GREEDY).content[0].text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    assert stop.strip(), whole
    message = client.messages.create(model=model, max_tokens=24, messages=ASK, **GREEDY, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == whole[: whole.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_gives_tool_use_blocks(client, model, stream, choice):
    kwargs = dict(model=model, max_tokens=200, messages=ASK, tools=[ANTHROPIC_WEATHER], tool_choice=choice)
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls, message
    for call in calls:
        assert call.name == "get_weather" and call.id
        jsonschema.validate(call.input, PARAMETERS["get_weather"])
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_cut_by_max_tokens_says_max_tokens(client, model, stream):
    """Its input is incomplete: ``tool_use`` would tell the client to run it."""
    kwargs = dict(
        model=model,
        max_tokens=3,
        messages=ASK,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_a_final_assistant_message_is_continued(client, chat, model):
    """Anthropic's prefill: the answer goes on from the assistant's text, in the same turn."""
    prefill = "The weather in Paris is"
    messages = [*ASK, {"role": "assistant", "content": prefill}]
    message = client.messages.create(model=model, max_tokens=12, messages=messages, **GREEDY)
    expected = _greedy_chat(
        chat, model, messages, 12, extra_body={"add_generation_prompt": False, "continue_final_message": True}
    )
    assert message.content[0].text == expected.choices[0].message.content
    counted = client.messages.count_tokens(model=model, messages=messages)
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_tool_results_go_back_through_the_template(client, chat, model):
    call = {"id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "unit": "C"}}
    messages = [
        *ASK,
        {"role": "assistant", "content": [{"type": "tool_use", **call}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 degrees"}]},
    ]
    message = client.messages.create(model=model, max_tokens=16, messages=messages, **GREEDY)
    openai_messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "12 degrees"},
    ]
    expected = _greedy_chat(chat, model, openai_messages, 16)
    assert message.content[0].text == expected.choices[0].message.content
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == expected.usage.prompt_tokens


def test_count_tokens_counts_the_rendered_prompt(client, chat, model, server):
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=ASK)
    expected = _greedy_chat(chat, model, [{"role": "system", "content": SYSTEM}, *ASK], 1)
    assert counted.input_tokens == expected.usage.prompt_tokens
    with_tools = client.messages.count_tokens(model=model, messages=ASK, tools=[ANTHROPIC_WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model=model, messages=ASK).input_tokens


BAD_MESSAGES = [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, 400, "max_tokens must be at least 1"),
    ({"max_tokens": 8, "messages": []}, 400, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image"),
    ({"max_tokens": 8, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "tool_choice needs tools"),
    ({"max_tokens": 8, "messages": ASK, "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool"}}, 400, "name"),
    ({"max_tokens": 8, "messages": ASK, "temperature": -1}, 400, "temperature"),
    ({"max_tokens": 10**6, "messages": ASK}, 400, "maximum context length"),
    (
        {
            "max_tokens": 8,
            "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
        },
        400,
        "tool_result blocks belong to user messages",
    ),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_MESSAGES)
def test_bad_bodies_are_anthropic_errors_and_leave_the_engine_idle(server, model, body, status, message):
    got, reply = server.http.request("POST", "/v1/messages", {"model": model, **body})
    assert got == status, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert message in reply["error"]["message"]
    assert wait_for(lambda: engine_idle(server))


def test_the_client_sees_its_own_error_types(client, model):
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="claude-unknown", max_tokens=8, messages=ASK)
    assert error.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [{"type": "image"}]}])


def test_the_key_may_come_in_x_api_key(tool_model):  # noqa: F811 - the imported fixture
    server = InProcessServer(
        [tool_model, "--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--api-key", "sekrit"]
    )
    try:
        base_url = f"http://127.0.0.1:{server.port}"
        good = anthropic.Anthropic(base_url=base_url, api_key="sekrit", max_retries=0)
        model = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sekrit", max_retries=0).models.list().data[0].id
        assert good.messages.create(model=model, max_tokens=4, messages=ASK).usage.output_tokens >= 1
        bad = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as error:
            bad.messages.create(model=model, max_tokens=4, messages=ASK)
        assert error.value.body["error"]["type"] == "authentication_error"
        # x-api-key is Anthropic's header: the OpenAI routes still want a bearer token.
        status, _ = server.http.request("GET", "/v1/models", headers={"x-api-key": "sekrit"})
        assert status == 401
    finally:
        server.close()
