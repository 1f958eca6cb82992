"""Structured outputs end to end: a random-weight model constrained by JSON schemas, regexes,
choices and grammars writes output that parses and validates, greedy and sampled, with n > 1,
under preemption and with prefix hits; bad constraints are refused and leave no trace."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedrs import LLM, SamplingParams
from pagedrs.sampling_params import StructuredOutputsParams

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array with bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum, boolean and bounded integer": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["color", "ok", "age"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
}
PROMPTS = ["Give me a record:", "JSON please", "Another record, different this time:"]


@pytest.fixture(scope="module")
def llm(tiny_smol):
    return LLM(model=tiny_smol, device="cpu", kv_cache_memory="16MiB", max_model_len=512, seed=0)


def _texts(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[tuple[str, str | None]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(choice.text, choice.finish_reason) for output in outputs for choice in output.outputs]


def _idle(llm: LLM) -> bool:
    engine = llm.engine
    return (
        not engine.has_unfinished_requests()
        and engine.scheduler.stats().num_used_blocks == 0
        and not len(engine.grammars)
    )


@pytest.mark.parametrize("schema_name", SCHEMAS)
@pytest.mark.parametrize("sampling", ["greedy", "sampled n=2"])
def test_every_output_validates_against_its_schema(llm, schema_name, sampling):
    schema = SCHEMAS[schema_name]
    settings = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=1.0, n=2, seed=5)
    params = SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema), **settings)
    for text, finish_reason in _texts(llm, params):
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert _idle(llm)


def test_json_object_regex_choice_and_grammar(llm):
    # Any JSON object: nothing bounds its strings, so a random model may still be writing one
    # at max_tokens; what it finished must parse.
    any_object = StructuredOutputsParams(json_object=True)
    outputs = _texts(llm, SamplingParams(temperature=0, max_tokens=300, structured_outputs=any_object))
    assert all(text.startswith("{") for text, _ in outputs)
    assert all(isinstance(json.loads(text), dict) for text, reason in outputs if reason == "stop")
    pattern = r"(yes|no), [0-9]{2,4}!"
    regex = SamplingParams(
        temperature=1.0, seed=3, max_tokens=50, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    assert all(re.fullmatch(pattern, text) for text, _ in _texts(llm, regex))
    choices = ["alpha", "beta gamma", "δέλτα"]
    choice = SamplingParams(temperature=1.0, n=3, seed=1, structured_outputs=StructuredOutputsParams(choice=choices))
    assert all(text in choices for text, _ in _texts(llm, choice))
    grammar = 'start: "sum(" NUMBER ("+" NUMBER)~0..3 ")"\nNUMBER: /[0-9]{1,3}/'
    lark = SamplingParams(
        temperature=1.0, seed=2, max_tokens=60, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )
    assert all(re.fullmatch(r"sum\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)", text) for text, _ in _texts(llm, lark))
    assert _idle(llm)


def test_constraints_hold_under_preemption_and_prefix_hits(tiny_smol):
    """A KV cache too small for the batch preempts and recomputes constrained sequences; the
    shared prompt is served from the prefix cache. Greedy output equals the same requests
    run alone."""
    schema = SCHEMAS["enum, boolean and bounded integer"]
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema))
    prompt = "A shared prefix long enough to fill whole blocks of the cache, twice over: " * 3
    prompts = [prompt + f"record {i}" for i in range(12)]
    alone = LLM(model=tiny_smol, device="cpu", kv_cache_memory="16MiB", max_model_len=512)
    expected = [alone.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in prompts[:3]]
    small = LLM(model=tiny_smol, device="cpu", kv_cache_memory="128KiB", max_model_len=512, max_num_seqs=12)
    outputs = small.generate(prompts, params, use_tqdm=False)
    stats = small.engine.scheduler.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert [output.outputs[0].text for output in outputs[:3]] == expected
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert _idle(small)


@pytest.mark.parametrize(
    "constraint, message",
    [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(regex="(unclosed"), "regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
    ],
    ids=["unknown type", "schema not JSON", "bad regex", "grammar with an undefined rule"],
)
def test_a_bad_constraint_is_refused_and_leaves_no_trace(llm, constraint, message):
    before = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError, match=re.compile(message, re.IGNORECASE)):
        llm.generate(["fine", "also fine"], SamplingParams(max_tokens=5, structured_outputs=constraint), use_tqdm=False)
    assert _idle(llm)
    assert (
        llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].text == before
    )


def test_compiled_grammars_are_cached(llm):
    grammars = llm.engine.grammars
    params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMAS["optional fields"]))
    llm.generate("first", params, use_tqdm=False)
    compiled, hits = grammars.num_compiled, grammars.cache_hits
    llm.generate(["second", "third"], params, use_tqdm=False)
    assert grammars.num_compiled == compiled and grammars.cache_hits == hits + 2


def test_a_finished_constraint_outranks_min_tokens(llm):
    """A choice constraint is done after a couple of tokens; min_tokens=20 would ban the EOS
    that is then the only token left. The output ends as the constraint says."""
    params = SamplingParams(
        min_tokens=20, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    outputs = llm.generate(["Answer:", "Reply:"], params, use_tqdm=False)
    assert all(output.error is None for output in outputs)
    assert all(
        output.outputs[0].text in ("yes", "no") and output.outputs[0].finish_reason == "stop" for output in outputs
    )
    # It ends at its one EOS, not with EOS after EOS up to min_tokens.
    eos = llm.engine.eos_token_id
    assert all(
        output.outputs[0].token_ids.count(eos) == 1 == output.outputs[0].token_ids[-1:].count(eos) for output in outputs
    )
    assert _idle(llm)


def test_properties_come_in_the_schemas_order(llm):
    schema = SCHEMAS["enum, boolean and bounded integer"]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    (text, _), *_ = _texts(llm, params, ["Record:"])
    assert list(json.loads(text)) == list(schema["properties"]) == ["color", "ok", "age"]
