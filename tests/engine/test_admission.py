"""Atomic admission and per-request failure in the engine: a request the engine refuses leaves
no trace (the engine's requests, the core's counters and the sampler's state are exactly as
before), and a request that breaks in the sampler fails alone, not its batch."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedrs import LLMEngine, SamplingParams
from pagedrs.sampling_params import MIN_FLOAT32_PARAM, MIN_TEMPERATURE

VOCAB = 320  # tests/helpers/checkpoints.py TINY


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(model=tiny_llama, device="cpu", kv_cache_memory="8MiB", max_model_len=64, seed=0)


def _state(engine: LLMEngine) -> tuple:
    """Everything a refused request could have left behind."""
    stats = engine.scheduler.stats()
    return (
        sorted(engine._requests),
        engine.scheduler.has_unfinished_requests(),
        stats.num_running,
        stats.num_waiting,
        stats.num_used_blocks,
        stats.num_cached_free_blocks,
        engine.sampler.penalties.num_slots_in_use,
    )


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = [choice.token_ids for choice in output.outputs]
    return outputs


def _reference(engine: LLMEngine) -> list[int]:
    engine.add_request("reference", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return _run(engine)["reference"][0]


# Requests the engine must refuse: (prompt, params keyword arguments, add_request keywords).
BAD_REQUESTS = {
    "seed past 64 bits": ([5, 6], {"seed": 2**64}, {}),
    "seed 2**64-1 with n=2": ([5, 6], {"seed": 2**64 - 1, "n": 2}, {}),
    "seed below -2**63": ([5, 6], {"seed": -(2**63) - 1}, {}),
    "temperature +inf": ([5, 6], {"temperature": math.inf}, {}),
    "temperature nan": ([5, 6], {"temperature": math.nan}, {}),
    "top_p nan": ([5, 6], {"top_p": math.nan}, {}),
    "presence_penalty -inf": ([5, 6], {"presence_penalty": -math.inf}, {}),
    "stop token 2**63": ([5, 6], {"stop_token_ids": [2**63]}, {}),
    "stop token past the vocabulary": ([5, 6], {"stop_token_ids": [VOCAB]}, {}),
    "prompt token past the vocabulary": ([5, VOCAB], {}, {}),
    "negative prompt token": ([-1, 5], {}, {}),
    "empty prompt": ([], {}, {}),
    "prompt of max_model_len tokens": ([5] * 64, {}, {}),
    "max_tokens past 64 bits": ([5, 6], {"max_tokens": 2**64}, {}),
    "priority past 64 bits": ([5, 6], {}, {"priority": 2**63}),
    "n past max_num_seqs": ([5, 6], {"n": 2**62}, {}),
    "penalties and a bad prompt token": ([5, 10**9], {"presence_penalty": 1.0, "n": 3}, {}),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_a_refused_request_leaves_no_trace(engine, case):
    before = _state(engine)
    reference = _reference(engine)
    prompt, params, keywords = BAD_REQUESTS[case]
    with pytest.raises(ValueError):
        engine.add_request("bad", prompt, SamplingParams(**params), **keywords)
        # Still here: the params were fine, the engine must refuse the rest.
    assert _state(engine) == before
    assert _reference(engine) == reference


def test_a_request_the_core_refuses_gives_back_its_sampler_state(engine, monkeypatch):
    """Penalty slots and generators are built before the core sees the request; when the
    core refuses it, they are released."""
    before = _state(engine)

    def refuse(*args, **kwargs):
        raise ValueError("refused by the core")

    monkeypatch.setattr(engine, "scheduler", _Refusing(engine.scheduler, refuse))
    with pytest.raises(ValueError, match="refused by the core"):
        engine.add_request("penalized", [5, 6], SamplingParams(n=4, seed=3, repetition_penalty=1.3))
    monkeypatch.undo()
    assert _state(engine) == before


class _Refusing:
    """The scheduler, with `add_request` replaced."""

    def __init__(self, scheduler, add_request):
        self._scheduler, self.add_request = scheduler, add_request

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(min_value=-(2**65), max_value=2**65), min_size=0, max_size=70),
    seed=st.one_of(st.none(), st.integers(min_value=-(2**66), max_value=2**66)),
    temperature=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(1e-320)),
    n=st.integers(min_value=-2, max_value=4),
    presence_penalty=st.one_of(st.floats(min_value=-3, max_value=3), st.just(math.nan)),
    stop_token_ids=st.lists(st.integers(min_value=-5, max_value=2**64), max_size=3),
)
def test_any_request_is_either_served_or_leaves_no_trace(
    engine, prompt, seed, temperature, n, presence_penalty, stop_token_ids
):
    before = _state(engine)
    try:
        params = SamplingParams(
            n=n,
            seed=seed,
            temperature=temperature,
            presence_penalty=presence_penalty,
            stop_token_ids=stop_token_ids,
            max_tokens=3,
        )
        engine.add_request("fuzzed", prompt, params)
    except ValueError:
        assert _state(engine) == before
        return
    outputs = _run(engine)["fuzzed"]
    assert len(outputs) == n and all(1 <= len(tokens) <= 3 and max(tokens) < VOCAB for tokens in outputs)
    assert _state(engine) == before


def test_tiny_temperatures_are_clamped_and_sample(engine):
    params = SamplingParams(temperature=1e-320, max_tokens=4, ignore_eos=True)
    assert params.temperature == MIN_TEMPERATURE
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("tiny", [5, 6, 7], params)
    engine.add_request("greedy", [5, 6, 7], greedy)
    outputs = _run(engine)
    assert outputs["tiny"] == outputs["greedy"]  # 0.01 is all but greedy on these logits


def test_tiny_top_p_and_repetition_penalty_are_raised_to_what_float32_holds(engine):
    """1e-320 is 0 in float32: top_p would keep nothing, the penalty would divide by 0."""
    params = SamplingParams(temperature=1.0, top_p=1e-320, repetition_penalty=1e-320, max_tokens=4, ignore_eos=True)
    assert params.top_p == params.repetition_penalty == MIN_FLOAT32_PARAM
    engine.add_request("tiny", [5, 6, 7], params)
    (tokens,) = _run(engine)["tiny"]
    assert len(tokens) == 4 and max(tokens) < VOCAB


class _PoisonedSampler:
    """The engine's sampler (``sampler``), which a subclass's ``__call__`` spoils for the rows
    of the ``poisoned`` params."""

    def __init__(self, sampler, poisoned):
        self.sampler, self.poisoned = sampler, poisoned

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def _poisoned_request_error(engine, monkeypatch, sampler_class) -> str | None:
    """Runs "a" and "b" (greedy) alone, then again beside "poisoned" (its own params) with the
    engine's sampler replaced by ``sampler_class(sampler, poisoned params)``; checks that "a"
    and "b" get the same tokens both times and that every block comes back; returns the
    poisoned request's error."""
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], greedy)
    engine.add_request("b", [8, 9], greedy)
    expected = _run(engine)
    poisoned = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True, seed=1)
    monkeypatch.setattr(engine, "sampler", sampler_class(engine.sampler, poisoned))
    engine.add_request("a", [5, 6, 7], greedy)
    engine.add_request("poisoned", [10, 11], poisoned)
    engine.add_request("b", [8, 9], greedy)
    errors = {}
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                errors[output.request_id] = output.error
                outputs[output.request_id] = [choice.token_ids for choice in output.outputs]
    monkeypatch.undo()
    assert errors["a"] is None and errors["b"] is None
    assert outputs["a"] == expected["a"] and outputs["b"] == expected["b"]
    assert engine.scheduler.stats().num_used_blocks == 0
    return errors["poisoned"]


def test_a_row_that_breaks_the_sampler_fails_its_request_alone(engine, monkeypatch):
    """The batch is sampled row by row when it fails; only the request whose row fails
    alone ends with an error, and the others get the tokens they would have got."""

    class BreaksOnPoison(_PoisonedSampler):
        def __call__(self, logits, rows, banned=(), allowed=None):
            if any(row.params is self.poisoned for row in rows):
                raise RuntimeError("this row cannot be sampled")
            return self.sampler(logits, rows, banned, allowed)

    assert "cannot be sampled" in _poisoned_request_error(engine, monkeypatch, BreaksOnPoison)


@pytest.mark.parametrize("bad_token", [-1, VOCAB])
def test_a_token_outside_the_vocabulary_fails_its_request_alone(engine, monkeypatch, bad_token):
    """A sampled id outside the vocabulary (non-finite logits drawn from on a device without
    checks) ends that request with an error; the others of the batch go on unchanged."""

    class DrawsOutsideOnPoison(_PoisonedSampler):
        def __call__(self, logits, rows, banned=(), allowed=None):
            sampled = self.sampler(logits, rows, banned, allowed)
            for index, row in enumerate(rows):
                if row.params is self.poisoned:
                    sampled.token_ids[index] = bad_token
            return sampled

    assert "not finite" in _poisoned_request_error(engine, monkeypatch, DrawsOutsideOnPoison)
