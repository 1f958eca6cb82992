"""Tool-call and reasoning parsers: what ``extract`` reads out of finished outputs, and that the
streaming side, fed the same text in any chunking, sends deltas that reassemble to exactly that
(same content, same calls in the same order, ids well-formed), never showing part of a marker."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from pagedrs.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    get_reasoning_parser,
)
from pagedrs.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    get_tool_parser,
)
from pagedrs.server.tool_stream import ToolCall, ToolParser

Call = tuple[str, dict[str, Any]]  # (name, arguments), as a case expects them

WEATHER = {"city": "Paris", "unit": "celsius"}
UNICODE = {"city": "Zürich", "note": "東京 🌧️ naïve", "quote": 'say "hi"\\n\n', "empty": ""}
# Brackets and escapes inside strings, which must not end a call's JSON early.
TRICKY = {"code": 'if s == "}": print("]")', "path": "C:\\dir\\", "quote": '\\"{[', "nested": {"a": [{"b": []}]}}


def hermes_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def llama_call(name: str, arguments: Any, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False)


def mistral_list(*calls: Call) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def mistral_v11(name: str, arguments: Any) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]" + json.dumps(arguments, ensure_ascii=False)


# Malformed markup: the whole output comes back as content.
VERBATIM = "(the output, verbatim)"

# (case id, output text, expected content, expected calls)
HERMES_CASES: list[tuple[str, str, str | None, list[Call]]] = [
    ("plain", "The capital of France is Paris.", "The capital of France is Paris.", []),
    (
        "plain_kept_verbatim",
        "\n  a < b, <tool and <tool_cal are text\n\n",
        "\n  a < b, <tool and <tool_cal are text\n\n",
        [],
    ),
    ("whitespace_only", " \n\t ", None, []),
    ("one_call", hermes_call("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    (
        "content_before",
        "Let me check the weather.\n\n" + hermes_call("get_weather", WEATHER),
        "Let me check the weather.",
        [("get_weather", WEATHER)],
    ),
    (
        "two_calls_content_before_and_after",
        "I'll call two tools.\n" + hermes_call("a", {"x": 1}) + "\n" + hermes_call("b", {"y": [1, 2]}) + "\nDone.",
        "I'll call two tools.\nDone.",
        [("a", {"x": 1}), ("b", {"y": [1, 2]})],
    ),
    ("unicode_arguments", "Voilà: " + hermes_call("translate", UNICODE), "Voilà:", [("translate", UNICODE)]),
    ("brackets_in_strings", hermes_call("run", TRICKY), None, [("run", TRICKY)]),
    ("no_arguments", '<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
    (
        "arguments_as_string",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [("f", {"a": 1})],
    ),
    ("unterminated_but_complete", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", {"a": 1})]),
    ("cut_inside_end_marker", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_', None, [("f", {})]),
    ("malformed_json", 'Try: <tool_call>\n{"name": "f", "arguments": {"x": }}\n</tool_call>', VERBATIM, []),
    ("truncated_json", '<tool_call>\n{"name": "f", "argum', VERBATIM, []),
    ("missing_name", '<tool_call>{"arguments": {}}</tool_call>', VERBATIM, []),
    ("arguments_not_an_object", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', VERBATIM, []),
    ("nan_is_not_json", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', VERBATIM, []),
    (
        "malformed_then_valid",
        "<tool_call>{oops}</tool_call>\n" + hermes_call("g", {}),
        "<tool_call>{oops}</tool_call>",
        [("g", {})],
    ),
]

LLAMA_CASES: list[tuple[str, str, str | None, list[Call]]] = [
    ("plain", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("json_answer_is_content", '{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),
    ("one_call", llama_call("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    ("python_tag", "<|python_tag|>" + llama_call("f", {"x": 1}), None, [("f", {"x": 1})]),
    (
        "two_calls_semicolon_and_arguments_alias",
        llama_call("a", {"x": 1}) + "; " + llama_call("b", {"y": [1, 2]}, key="arguments"),
        None,
        [("a", {"x": 1}), ("b", {"y": [1, 2]})],
    ),
    (
        "two_calls_newline",
        llama_call("a", {}) + "\n" + llama_call("b", {}),
        None,
        [("a", {}), ("b", {})],
    ),
    ("trailing_semicolon", "\n" + llama_call("a", {}) + ";\n", None, [("a", {})]),
    ("content_after", llama_call("a", {"q": 1}) + "\nI called a.", "I called a.", [("a", {"q": 1})]),
    ("content_before_means_no_call", "Sure! " + llama_call("a", {}), "Sure! " + llama_call("a", {}), []),
    ("type_key", '{"type": "function", "name": "a", "parameters": {"x": 1}}', None, [("a", {"x": 1})]),
    ("unicode_arguments", llama_call("translate", UNICODE), None, [("translate", UNICODE)]),
    ("brackets_in_strings", llama_call("run", TRICKY) + ";" + llama_call("f", {}), None, [("run", TRICKY), ("f", {})]),
    ("malformed_json", '{"name": "a", "parameters": {"x": 1,}}', VERBATIM, []),
    ("missing_parameters", '{"name": "Bob"}', VERBATIM, []),
    ("python_tag_code", "<|python_tag|>print(1 + 1)", VERBATIM, []),
    ("malformed_second_call", llama_call("a", {}) + '; {"name": 5}', '; {"name": 5}', [("a", {})]),
]

MISTRAL_CASES: list[tuple[str, str, str | None, list[Call]]] = [
    ("plain", "Use a[0] and [1, 2], not [TOOL.", "Use a[0] and [1, 2], not [TOOL.", []),
    ("one_call", mistral_list(("get_weather", WEATHER)), None, [("get_weather", WEATHER)]),
    (
        "two_calls_list",
        "[TOOL_CALLS] " + mistral_list(("a", {"x": 1}), ("b", {}))[len("[TOOL_CALLS]") :],
        None,
        [("a", {"x": 1}), ("b", {})],
    ),
    ("content_before", "Let me check. " + mistral_list(("f", {})), "Let me check.", [("f", {})]),
    ("single_object", '[TOOL_CALLS]{"name": "a", "arguments": {}}', None, [("a", {})]),
    ("v11_one_call", mistral_v11("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    (
        "v11_two_calls",
        mistral_v11("a", {"x": 1}) + mistral_v11("b", {"y": "z"}),
        None,
        [("a", {"x": 1}), ("b", {"y": "z"})],
    ),
    (
        "v11_content_before_and_after",
        "Checking.\n" + mistral_v11("a", {}) + "\nDone.",
        "Checking.\nDone.",
        [("a", {})],
    ),
    ("unicode_arguments", mistral_list(("translate", UNICODE)), None, [("translate", UNICODE)]),
    ("v11_unicode_arguments", mistral_v11("translate", UNICODE), None, [("translate", UNICODE)]),
    ("brackets_in_strings", mistral_list(("run", TRICKY)) + " ok", "ok", [("run", TRICKY)]),
    ("v11_brackets_in_strings", mistral_v11("run", TRICKY) + mistral_v11("f", {}), None, [("run", TRICKY), ("f", {})]),
    ("malformed_list", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}]', VERBATIM, []),
    ("malformed_v11_arguments", '[TOOL_CALLS]a[ARGS]{"x": }', VERBATIM, []),
    ("empty_list", "[TOOL_CALLS][]", VERBATIM, []),
    ("bad_name", "[TOOL_CALLS]bad name[ARGS]{}", VERBATIM, []),
    ("truncated", '[TOOL_CALLS][{"name": "a", "arguments": {"x": "unfinished', VERBATIM, []),
]

CASES_BY_PARSER: dict[type[ToolParser], list[tuple[str, str, str | None, list[Call]]]] = {
    HermesToolParser: HERMES_CASES,
    Llama3JsonToolParser: LLAMA_CASES,
    MistralToolParser: MISTRAL_CASES,
}
PARSER_CASES = [
    pytest.param(parser, text, content, calls, id=f"{parser.name}-{case}")
    for parser, cases in CASES_BY_PARSER.items()
    for case, text, content, calls in cases
]


def reassemble(deltas: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """Content and calls from a stream's deltas, checking each delta's shape on the way."""
    content = ""
    calls: list[ToolCall] = []
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            assert delta["content"], "an empty content delta"
            content += delta["content"]
            continue
        [entry] = delta["tool_calls"]
        if "id" in entry:  # a call's first delta
            assert entry["index"] == len(calls)
            assert entry["type"] == "function"
            assert entry["function"]["arguments"] == ""
            calls.append(ToolCall(entry["id"], entry["function"]["name"], ""))
        else:  # an argument fragment, always of the latest call
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            assert entry["index"] == len(calls) - 1
            calls[-1].arguments += entry["function"]["arguments"]
    return content, calls


def events(deltas: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The order of things in a stream: content runs and whole calls (ids left out: random)."""
    merged: list[tuple[str, ...]] = []
    for delta in deltas:
        if "content" in delta:
            if merged and merged[-1][0] == "content":
                merged[-1] = ("content", merged[-1][1] + delta["content"])
            else:
                merged.append(("content", delta["content"]))
            continue
        [entry] = delta["tool_calls"]
        if "id" in entry:
            merged.append(("call", entry["function"]["name"], ""))
        else:
            merged[-1] = ("call", merged[-1][1], merged[-1][2] + entry["function"]["arguments"])
    return merged


def stream_chunks(parser: Any, chunks: list[str]) -> list[dict[str, Any]]:
    stream = parser.stream()
    deltas = []
    for chunk in chunks:
        deltas += stream.feed(chunk)
    return deltas + stream.finish()


def chunkings(text: str, seed: int) -> list[list[str]]:
    """The text whole, split in two at every character boundary, one character at a time, and
    in random pieces (empty ones too)."""
    result = [[text], list(text)]
    result += [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    rng = random.Random(seed)
    for _ in range(20):
        pieces, position = [], 0
        while position < len(text):
            size = rng.choice((0, 1, 1, 2, 3, 5, 8, 13))
            pieces.append(text[position : position + size])
            position += size
        result.append(pieces)
    return result


def id_pattern(parser: ToolParser) -> str:
    return r"[A-Za-z0-9]{9}" if isinstance(parser, MistralToolParser) else r"call_[A-Za-z0-9]{24}"


@pytest.mark.parametrize(("parser_class", "text", "content", "calls"), PARSER_CASES)
def test_extract_reads_content_and_calls(parser_class, text, content, calls):
    parser = parser_class()
    got_content, got_calls = parser.extract(text)
    assert got_content == (text if content == VERBATIM else content)
    assert [(call.name, json.loads(call.arguments)) for call in got_calls] == calls
    for call in got_calls:
        # Arguments are re-serialized (json.dumps, unicode kept as is), the way vLLM sends them.
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
        assert re.fullmatch(id_pattern(parser), call.id)
    assert len({call.id for call in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("parser_class", "text", "content", "calls"), PARSER_CASES)
def test_stream_in_any_chunking_reassembles_to_extract(parser_class, text, content, calls):
    parser = parser_class()
    extracted_content, extracted_calls = parser.extract(text)
    whole = events(stream_chunks(parser, [text]))
    for chunks in chunkings(text, seed=len(text)):
        deltas = stream_chunks(parser, chunks)
        streamed_content, streamed_calls = reassemble(deltas)
        assert streamed_content == (extracted_content or ""), chunks
        assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in extracted_calls]
        assert all(re.fullmatch(id_pattern(parser), call.id) for call in streamed_calls)
        assert len({call.id for call in streamed_calls}) == len(streamed_calls)
        assert events(deltas) == whole, chunks


MARKER_STARTS = {HermesToolParser: "<", Llama3JsonToolParser: "<{;", MistralToolParser: "["}


@pytest.mark.parametrize(
    ("parser_class", "text"),
    # Cases with calls, and with content free of a marker's first character.
    [
        pytest.param(parser, text, id=f"{parser.name}-{case}")
        for parser, cases in CASES_BY_PARSER.items()
        for case, text, content, calls in cases
        if calls and not set(content or "") & set(MARKER_STARTS[parser])
    ],
)
def test_no_piece_of_a_marker_is_sent_as_content(parser_class, text):
    """Fed one character at a time, a call's markup never leaks into content deltas, not even its
    first character while it is still undecided."""
    for delta in stream_chunks(parser_class(), list(text)):
        if "content" in delta:
            assert not any(char in delta["content"] for char in MARKER_STARTS[parser_class]), delta


@pytest.mark.parametrize("parser_class", list(TOOL_PARSERS.values()))
def test_plain_text_streams_without_delay(parser_class):
    """Only text that may start a marker, and whitespace, is held back."""
    text = "The weather in Paris is mild today, around 18 degrees."
    stream = parser_class().stream()
    sent = ""
    for position, char in enumerate(text):
        sent += "".join(delta["content"] for delta in stream.feed(char))
        assert sent == text[: position + 1].rstrip()
    sent += "".join(delta["content"] for delta in stream.finish())
    assert sent == text
    assert not stream.saw_tool_call


@pytest.mark.parametrize("parser_class", list(TOOL_PARSERS.values()))
def test_a_call_is_sent_as_soon_as_its_region_is_read(parser_class):
    text = {
        HermesToolParser: hermes_call("f", {"a": 1}),
        Llama3JsonToolParser: llama_call("f", {"a": 1}),
        MistralToolParser: mistral_v11("f", {"a": 1}),
    }[parser_class]
    stream = parser_class().stream()
    for char in text[:-1]:
        assert stream.feed(char) == []
    deltas = stream.feed(text[-1])
    assert [call.name for call in reassemble(deltas)[1]] == ["f"]
    assert stream.saw_tool_call
    assert stream.finish() == []


def test_a_json_answer_is_not_held_to_its_closing_brace():
    """Llama: an output opening with "{" may be a call; its first key says whether it is."""
    stream = Llama3JsonToolParser().stream()
    assert stream.feed('{"a') == []  # may be "arguments"
    assert stream.feed("n") == [{"content": '{"an'}]
    assert stream.feed('swer": [1, 2') == [{"content": 'swer": [1, 2'}]


def test_ids_are_openai_style_except_mistral():
    hermes = HermesToolParser()
    ids = {hermes.new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call_id) for call_id in ids)
    # Mistral's chat templates refuse any tool_call_id but 9 letters and digits.
    assert re.fullmatch(r"[A-Za-z0-9]{9}", MistralToolParser().new_call_id())


def test_tool_call_as_openai_message_entry():
    call = ToolCall("call_x", "f", '{"a": 1}')
    assert call.to_openai() == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_parsers_are_registered_by_vllm_names():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("granite")
    # The markers of these two are special tokens: the engine must keep them in the text.
    assert MistralToolParser.needs_special_tokens and Llama3JsonToolParser.needs_special_tokens
    assert not HermesToolParser.needs_special_tokens


def test_a_finished_stream_refuses_more_text():
    stream = HermesToolParser().stream()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("more")
    with pytest.raises(RuntimeError):
        stream.finish()


def test_absurdly_deep_json_is_content_not_an_error():
    text = "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>"
    assert HermesToolParser().extract(text) == (text, [])


# Pieces that random outputs are made of: markers whole and cut, calls valid and not, JSON
# punctuation, whitespace, unicode.
FUZZ_PIECES = {
    HermesToolParser: [
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "</tool",
        "<",
        hermes_call("f", {"x": 1}),
        hermes_call("g", UNICODE),
        '{"name": "h", "arguments": {}}',
        '{"name": ',
    ],
    Llama3JsonToolParser: [
        "<|python_tag|>",
        "<|python",
        llama_call("f", {"x": 1}),
        llama_call("g", UNICODE, key="arguments"),
        '{"name": "h"',
        '{"answer": 1}',
        ";",
        "{",
        "}",
    ],
    MistralToolParser: [
        "[TOOL_CALLS]",
        "[TOOL_",
        "[ARGS]",
        "[ARG",
        mistral_list(("f", {"x": 1})),
        mistral_v11("g", UNICODE),
        "f",
        '[{"name": "h", "arguments": {}}]',
        "[",
        "]",
    ],
}
COMMON_PIECES = ["\n", " ", "  \n", "text", "é東🌧", '"', "\\", "{", "}", "[", "]", ":", ",", "1"]


@pytest.mark.parametrize("parser_class", list(TOOL_PARSERS.values()))
def test_random_outputs_stream_exactly_as_extracted(parser_class):
    """Seeded random outputs built from marker pieces, calls and noise: extract never raises, and
    every chunking streams the same content and calls in the same order."""
    rng = random.Random(14)
    parser = parser_class()
    pieces = FUZZ_PIECES[parser_class] + COMMON_PIECES
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        extracted_content, extracted_calls = parser.extract(text)
        whole = events(stream_chunks(parser, [text]))
        for chunks in [list(text)] + chunkings(text, seed=rng.randint(0, 2**32))[-5:]:
            deltas = stream_chunks(parser, chunks)
            streamed_content, streamed_calls = reassemble(deltas)
            assert streamed_content == (extracted_content or ""), text
            assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in extracted_calls]
            assert events(deltas) == whole, text
        for call in extracted_calls:
            assert isinstance(json.loads(call.arguments), dict)


# Reasoning: (case id, output text, expected reasoning_content, expected content)
QWEN3_CASES: list[tuple[str, str, str | None, str | None]] = [
    ("think_then_answer", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("no_think_is_all_content", "The answer is 4.\n", None, "The answer is 4.\n"),
    ("whitespace_before_think", "\n <think>x</think>y", "x", "y"),
    ("think_not_at_start_is_content", "Answer: <think>x</think>", None, "Answer: <think>x</think>"),
    ("cut_off_while_thinking", "<think>\nstill thinking ", "still thinking", None),
    ("empty_think", "<think>\n\n</think>\n\nHi", None, "Hi"),
    ("only_reasoning", "<think>r</think>\n\n", "r", None),
    ("tag_like_text_inside", "<think>a < b </thin k</think>ok", "a < b </thin k", "ok"),
    ("unicode", "<think>Zürich → 東京 🌧️</think>Voilà", "Zürich → 東京 🌧️", "Voilà"),
    ("thinking_tag_is_not_think", "<thinking>x</thinking>", None, "<thinking>x</thinking>"),
    ("empty", "", None, None),
]

DEEPSEEK_R1_CASES: list[tuple[str, str, str | None, str | None]] = [
    ("no_opening_tag", "Let me think.\n</think>\n\nThe answer", "Let me think.", "The answer"),
    ("with_opening_tag", "<think>x</think>y", "x", "y"),
    ("no_end_tag_is_all_reasoning", "\njust thinking", "just thinking", None),
    ("empty_reasoning", "</think>Answer", None, "Answer"),
    ("first_end_tag_ends_reasoning", "a</think>b</think>c", "a", "b</think>c"),
    ("unicode", "東京 🌧️\n</think>\nVoilà", "東京 🌧️", "Voilà"),
    ("empty", "", None, None),
]

REASONING_CASES = [
    pytest.param(parser, text, reasoning, content, id=f"{parser.name}-{case}")
    for parser, cases in ((Qwen3ReasoningParser, QWEN3_CASES), (DeepSeekR1ReasoningParser, DEEPSEEK_R1_CASES))
    for case, text, reasoning, content in cases
]


def reassemble_reasoning(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(field, text) runs in order, checking each delta's shape."""
    runs: list[tuple[str, str]] = []
    for delta in deltas:
        [(field, text)] = delta.items()
        assert field in ("reasoning_content", "content") and text
        if runs and runs[-1][0] == field:
            runs[-1] = (field, runs[-1][1] + text)
        else:
            runs.append((field, text))
    return runs


@pytest.mark.parametrize(("parser_class", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_extract(parser_class, text, reasoning, content):
    assert parser_class().extract(text) == (reasoning, content)


@pytest.mark.parametrize(("parser_class", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_stream_in_any_chunking_reassembles_to_extract(parser_class, text, reasoning, content):
    parser = parser_class()
    # Reasoning, then content: never back.
    expected = [(field, value) for field, value in (("reasoning_content", reasoning), ("content", content)) if value]
    for chunks in chunkings(text, seed=len(text)):
        deltas = stream_chunks(parser, chunks)
        assert reassemble_reasoning(deltas) == expected, chunks
        if "<" not in (reasoning or "") + (content or ""):  # no piece of a tag, ever
            assert not any("<" in value for delta in deltas for value in delta.values())


def test_reasoning_streams_without_delay():
    stream = DeepSeekR1ReasoningParser().stream()
    sent = ""
    for position, char in enumerate("thinking about it"):
        sent += "".join(delta["reasoning_content"] for delta in stream.feed(char))
        assert sent == "thinking about it"[: position + 1].rstrip()
    assert stream.in_reasoning
    assert stream.feed(" </think> Answer") == [{"content": "Answer"}]
    assert not stream.in_reasoning


def test_random_outputs_reason_the_same_streamed():
    rng = random.Random(14)
    pieces = ["<think>", "</think>", "<thi", "</th", "<", "/", "\n", " ", "word", "東🌧", ">"]
    for parser_class in REASONING_PARSERS.values():
        parser: ReasoningParser = parser_class()
        for _ in range(300):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
            reasoning, content = parser.extract(text)
            expected = [(f, v) for f, v in (("reasoning_content", reasoning), ("content", content)) if v]
            for chunks in [list(text)] + chunkings(text, seed=rng.randint(0, 2**32))[-5:]:
                assert reassemble_reasoning(stream_chunks(parser, chunks)) == expected, text


def test_reasoning_parsers_are_registered_by_vllm_names():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


def test_reasoning_then_tool_calls_stream_as_extracted():
    """The chat endpoint's pipeline: the reasoning stream's content deltas feed the tool stream."""
    text = "<think>\nThe user wants weather.\n</think>\n\nChecking.\n" + hermes_call("get_weather", WEATHER)
    reasoning, content = Qwen3ReasoningParser().extract(text)
    assert reasoning == "The user wants weather."
    assert content is not None
    expected_content, expected_calls = HermesToolParser().extract(content)
    assert expected_content == "Checking."
    for chunks in chunkings(text, seed=3):
        reasoning_stream, tool_stream = Qwen3ReasoningParser().stream(), HermesToolParser().stream()
        reasoning_deltas, tool_deltas = [], []
        for chunk in [*chunks, None]:
            deltas = reasoning_stream.feed(chunk) if chunk is not None else reasoning_stream.finish()
            for delta in deltas:
                if "content" in delta:
                    tool_deltas += tool_stream.feed(delta["content"])
                else:
                    reasoning_deltas.append(delta)
        tool_deltas += tool_stream.finish()
        assert "".join(delta["reasoning_content"] for delta in reasoning_deltas) == reasoning
        streamed_content, streamed_calls = reassemble(tool_deltas)
        assert streamed_content == expected_content
        assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in expected_calls]
