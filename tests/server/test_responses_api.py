"""OpenAI's Responses API on a real server, driven by the official `openai` client: texts
equal the greedy chat completion of the same conversation, streams carry the Responses
events, ``text.format`` constrains the output, function tools give ``function_call`` items
whose results go back through the template, stored responses continue conversations and are
read and deleted by id (an unknown id is a 404), and bad bodies are 400s that leave the engine
idle."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from pagedrs.server.responses import ResponseStore
from tests.helpers.servers import InProcessServer, engine_idle, wait_for
from tests.server.test_server_tools import PARAMETERS, WEATHER, tool_model  # noqa: F401 - a fixture

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


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
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _greedy_chat(client, model: str, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


def test_a_response_equals_the_greedy_chat_completion(client, model, server):
    response = client.responses.create(
        model=model, instructions="Be brief.", input="Hello there", max_output_tokens=20, temperature=0
    )
    expected = _greedy_chat(
        client, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], 20
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == expected.choices[0].message.content
    assert response.status == ("incomplete" if expected.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens
    assert wait_for(lambda: engine_idle(server))


def test_message_items_with_parts_and_a_developer_role(client, model):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]},
    ]
    response = client.responses.create(model=model, input=items, max_output_tokens=12, temperature=0)
    expected = _greedy_chat(
        client, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], 12
    )
    assert response.output_text == expected.choices[0].message.content


def test_a_stream_carries_the_responses_events(client, model):
    whole = client.responses.create(model=model, input="Tell me a story", max_output_tokens=16, temperature=0)
    events = list(
        client.responses.create(model=model, input="Tell me a story", max_output_tokens=16, temperature=0, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_text.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    assert events[-1].response.output_text == whole.output_text


def test_structured_output_streamed_to_a_final_response(client, model):
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    with client.responses.stream(model=model, input="Pick a city", text=text, max_output_tokens=64) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), CITY)


def test_parse_with_a_pydantic_model(client, model):
    class City(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)

    parsed = client.responses.parse(model=model, input="Pick a city", text_format=City, max_output_tokens=64)
    assert isinstance(parsed.output_parsed, City)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tools_give_function_call_items(client, model, choice, stream):
    kwargs = dict(model=model, input="Weather in Paris?", tools=[RESPONSES_WEATHER], tool_choice=choice)
    if stream:
        with client.responses.stream(**kwargs, max_output_tokens=200) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs, max_output_tokens=200)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_weather"])


def test_function_results_go_back_through_the_template(client, model):
    arguments = '{"city": "Oslo", "unit": "C"}'
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 degrees"},
    ]
    response = client.responses.create(model=model, input=items, max_output_tokens=12, temperature=0)
    expected = _greedy_chat(
        client,
        model,
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"},
        ],
        12,
    )
    assert response.output_text == expected.choices[0].message.content


def test_previous_response_id_continues_and_stored_responses_are_read_and_deleted(client, model, server):
    first = client.responses.create(model=model, input="Hello there", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model=model, previous_response_id=first.id, input="And then?", max_output_tokens=8, temperature=0
    )
    expected = _greedy_chat(
        client,
        model,
        [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        8,
    )
    assert second.output_text == expected.choices[0].message.content
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=model, previous_response_id=first.id, input="x", max_output_tokens=4)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_unknown")
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert wait_for(lambda: engine_idle(server))


def test_the_store_drops_the_least_recently_used_by_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=8000)
    for name in "abc":
        store.put({"id": name}, [{"role": "user", "content": name}])
        if name == "b":
            assert store.get("a") is not None  # a is now the most recent
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None

    by_bytes = ResponseStore(max_responses=100, max_bytes=8000)
    for index in range(9):  # ~943 bytes each: the ninth goes over 8000
        by_bytes.put({"id": f"r{index}"}, [{"role": "user", "content": "x" * 900}])
    assert len(by_bytes) == 8 and by_bytes.get("r0") is None and by_bytes.get("r8") is not None
    # One response may take an eighth of the bound, so it cannot flush the others.
    by_bytes.put({"id": "huge"}, [{"role": "user", "content": "x" * 1100}])
    assert by_bytes.get("huge") is None and len(by_bytes) == 8 and by_bytes.get("r1") is not None


BAD_RESPONSES = [
    ({"input": []}, "input must not be empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role must be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "images"),
    ({"input": [{"type": "web_search_call"}]}, "not supported"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens must be at least 1"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "needs a schema"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": 5}, "input"),
]


@pytest.mark.parametrize(("body", "message"), BAD_RESPONSES)
def test_bad_bodies_are_400s_and_leave_the_engine_idle(server, body, message):
    status, reply = server.http.request("POST", "/v1/responses", body)
    assert status == 400, reply
    assert message in reply["error"]["message"]
    assert wait_for(lambda: engine_idle(server))
