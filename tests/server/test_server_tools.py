"""Structured outputs and tool calls through the OpenAI-compatible server, driven by the
official `openai` client: response_format, `chat.completions.parse` with a pydantic model,
tool_choice required / named / auto (streamed and not), tool results in the conversation,
reasoning content, and bad constraints refused with a 400 while the server goes on."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from tests.helpers.servers import InProcessServer, wait_for

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Hermes-style template that shows the tools and replays calls and results.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tiny_smol, tmp_path_factory) -> str:
    """The tiny byte-level model with a chat template that takes tools."""
    import shutil

    directory = tmp_path_factory.mktemp("tiny-smol-tools")
    shutil.copytree(tiny_smol, directory, dirs_exist_ok=True)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    (Path(directory) / "chat_template.jinja").unlink(missing_ok=True)
    return str(directory)


@pytest.fixture(scope="module")
def server(tool_model):
    server = InProcessServer(
        [tool_model, "--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "32MiB"]
        + ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def _model(client) -> str:
    return client.models.list().data[0].id


def _engine_idle(server) -> bool:
    engine = server.engine.engine
    return engine.scheduler.stats().num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_response_format_json_schema(client, server):
    schema = PARAMETERS["get_weather"]
    reply = client.chat.completions.create(
        model=_model(client),
        messages=ASK,
        max_tokens=60,
        n=2,
        temperature=1.0,
        seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert wait_for(lambda: _engine_idle(server))


def test_parse_with_a_pydantic_model(client):
    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)
        celsius: bool

    reply = client.chat.completions.parse(model=_model(client), messages=ASK, max_tokens=60, response_format=Weather)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Weather) and len(parsed.city) <= 8


def test_vllm_structured_output_fields(client):
    choice = client.chat.completions.create(
        model=_model(client), messages=ASK, max_tokens=10, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(
        model=_model(client), prompt="Code:", max_tokens=10, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"}
    )
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_always_parses(client, stream):
    # One call (parallel_tool_calls false): a random model would otherwise add calls until
    # max_tokens cut the list short.
    kwargs = dict(
        model=_model(client),
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
    )
    calls, finish_reason = _calls(client, kwargs, stream)
    assert finish_reason == "tool_calls" and len(calls) == 1
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_calls_that_tool(client, stream):
    kwargs = dict(
        model=_model(client),
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    calls, finish_reason = _calls(client, kwargs, stream)
    assert finish_reason == "stop" and [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0][1]), PARAMETERS["get_time"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_parses_a_hermes_call(client, stream):
    """The model's own choice, parsed by --tool-call-parser hermes (the random model is made
    to write a call by a regex, so the parser sees exactly what a tool model writes)."""
    kwargs = dict(
        model=_model(client),
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=80,
        extra_body={"guided_regex": "Let me check\\. " + FORCED_CALL.replace("{", "\\{").replace("}", "\\}")},
    )
    calls, finish_reason = _calls(client, kwargs, stream)
    assert finish_reason == "tool_calls"
    assert calls == [("get_weather", json.dumps({"city": "Oslo", "unit": "C"}))]


def test_tool_results_in_the_conversation(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    ]
    reply = client.chat.completions.create(
        model=_model(client), messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert reply.choices[0].message.tool_calls is None and reply.usage.completion_tokens >= 1


def test_reasoning_content_is_split_off(client):
    reply = client.chat.completions.create(
        model=_model(client),
        messages=ASK,
        max_tokens=40,
        extra_body={"guided_regex": "<think>[a-z]{1,6}</think>(sunny|rain)"},
    )
    message = reply.choices[0].message
    assert message.content in ("sunny", "rain") and message.reasoning_content.isalpha()


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "nope",
        ),
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one output constraint"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tool_choice": "required"}, "needs tools"),
    ],
    ids=["bad schema", "bad regex", "two fields", "two constraints", "unknown named tool", "required without tools"],
)
def test_bad_constraints_get_a_400_and_the_server_goes_on(client, server, extra, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=5, extra_body=extra)
    assert message in str(error.value)
    assert wait_for(lambda: _engine_idle(server))
    assert client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=3).choices[0].message


def _calls(client, kwargs, stream: bool) -> tuple[list[tuple[str, str]], str]:
    """``([(name, arguments)], finish_reason)``, from one response or a reassembled stream."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
        return calls, choice.finish_reason
    by_index: dict[int, list[str]] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = by_index.setdefault(call.index, ["", ""])
                if call.function.name:
                    assert call.id and call.type == "function"
                    entry[0] = call.function.name
                entry[1] += call.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return [(name, arguments) for name, arguments in by_index.values()], finish_reason


def test_metrics_count_constrained_requests_compiles_and_masks(client, server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    before = server.http.metrics()
    for _ in range(2):
        client.chat.completions.create(
            model=_model(client), messages=ASK, max_tokens=20, response_format=response_format
        )
    assert wait_for(
        lambda: (
            server.http.metrics()["pagedrs:structured_output_requests_total"]
            >= before.get("pagedrs:structured_output_requests_total", 0) + 2
        )
    )
    after = server.http.metrics()
    assert (
        after["pagedrs:structured_output_grammar_cache_hits_total"]
        >= before.get("pagedrs:structured_output_grammar_cache_hits_total", 0) + 1
    )
    assert after["pagedrs:structured_output_masked_rows_total"] > before.get(
        "pagedrs:structured_output_masked_rows_total", 0
    )
    assert after["pagedrs:structured_output_mask_seconds_total"] > 0
