"""`AsyncLLMEngine`: the engine loop on its thread, streams, aborts and failures."""

from __future__ import annotations

import asyncio

import pytest

from pagedrs import SamplingParams
from pagedrs.engine.async_engine import AsyncLLMEngine, QueueFullError
from pagedrs.engine.llm_engine import LLMEngine
from tests.helpers.servers import wait_for


@pytest.fixture
def engine(tiny_llama):
    engine = AsyncLLMEngine(LLMEngine(model=tiny_llama, device="cpu", kv_cache_memory="8MiB"))
    yield engine
    engine.shutdown()


async def _collect(engine, request_id, prompt, params):
    return [output async for output in engine.generate(request_id, prompt, params)]


def test_streams_match_the_offline_engine(engine, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 30]

    async def run():
        return await asyncio.gather(*(_collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))

    streams = asyncio.run(run())
    offline = LLMEngine(model=tiny_llama, device="cpu", kv_cache_memory="8MiB")
    for i, prompt in enumerate(prompts):
        offline.add_request(f"r{i}", prompt, params)
    expected = {}
    while offline.has_unfinished_requests():
        for output in offline.step():
            expected[output.request_id] = output.outputs[0].token_ids
    for i, outputs in enumerate(streams):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].token_ids == expected[f"r{i}"]
        # Cumulative snapshots: each one extends the last, and the engine never mutates them.
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and lengths[0] >= 1


def test_unfinished_text_holds_back_a_possible_stop_string(engine):
    free = asyncio.run(
        _collect(engine, "free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    )
    words = free[-1].outputs[0].text.split()
    stop = " ".join(words[3:5])  # two words in the middle: the text just before it must never show
    outputs = asyncio.run(
        _collect(
            engine, "stopped", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop])
        )
    )
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "stop" and stop not in final.text
    for output in outputs:
        assert final.text.startswith(output.outputs[0].text)


def test_leaving_a_stream_aborts_the_request(engine):
    async def run():
        seen = 0
        async for _ in engine.generate("long", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)):
            seen += 1
            if seen == 3:
                break
        return seen

    assert asyncio.run(run()) == 3
    assert wait_for(lambda: engine.stats.num_used_blocks == 0 and not engine.engine.has_unfinished_requests())


def test_bad_input_raises_value_error_and_queues_nothing(engine):
    with pytest.raises(ValueError, match="token ids"):
        asyncio.run(_collect(engine, "bad", [10**6], SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(_collect(engine, "bad", [], SamplingParams()))
    assert not engine.engine.has_unfinished_requests()
    assert asyncio.run(_collect(engine, "good", [5], SamplingParams(max_tokens=2, ignore_eos=True)))[-1].finished


def test_a_failed_forward_pass_fails_its_batch_only(engine):
    runner = engine.engine.runner
    execute = runner.execute
    calls = {"n": 0}

    def fail_once(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return execute(*args)

    runner.execute = fail_once
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(_collect(engine, f"r{i}", [5 + i, 6], params) for i in range(3)))

    results = asyncio.run(run())
    for outputs in results:
        assert outputs[-1].finished and "device fell over" in outputs[-1].error
        assert outputs[-1].outputs[0].finish_reason == "error"
    assert engine.stats.num_used_blocks == 0
    later = asyncio.run(_collect(engine, "later", [5, 6], params))
    assert later[-1].error is None and len(later[-1].outputs[0].token_ids) == 6


def test_queue_limit(tiny_llama):
    engine = AsyncLLMEngine(
        LLMEngine(model=tiny_llama, device="cpu", kv_cache_memory="8MiB", max_num_seqs=1), max_waiting_requests=1
    )
    try:
        # "a" must still be running when the checks below poll (every 50 ms): as long as the
        # tiny model's 512 positions allow, since its decode steps take well under a millisecond.
        params = SamplingParams(max_tokens=500, ignore_eos=True)

        async def run():
            first = await engine.add_request("a", [5, 6], params)
            # Until a step schedules it, "a" is waiting too, and counts against the limit.
            assert wait_for(lambda: engine.stats.num_running == 1, timeout=5)
            second = await engine.add_request("b", [5, 7], params)  # waits: one sequence at a time
            assert wait_for(lambda: engine.stats.num_waiting == 1, timeout=5)
            with pytest.raises(QueueFullError):
                await engine.add_request("c", [5, 8], params)
            first.abort()
            second.abort()

        asyncio.run(run())
        assert wait_for(lambda: engine.stats.num_used_blocks == 0 and engine.stats.num_waiting == 0)
    finally:
        engine.shutdown()


def test_stopping_the_engine_ends_waiting_streams(tiny_llama):
    from pagedrs.engine.async_engine import EngineDeadError

    engine = AsyncLLMEngine(LLMEngine(model=tiny_llama, device="cpu", kv_cache_memory="8MiB"))

    async def run():
        stream = await engine.add_request("long", [5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
        outputs = 0
        with pytest.raises(EngineDeadError, match="stopped"):
            async for _ in stream:
                outputs += 1
                if outputs == 2:
                    engine.stop()
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [5], SamplingParams())

    asyncio.run(run())
    engine.shutdown()
    assert not engine.is_alive()


def test_delta_streams_add_up_to_the_cumulative_outputs(engine):
    """``delta=True``: each output holds only what is new (tokens, text, logprobs); added up,
    the deltas are exactly the cumulative stream's last output."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, stop=["zz"])

    async def run():
        cumulative = await _collect(engine, "whole", [5, 6, 7], params)
        stream = await engine.add_request("parts", [5, 6, 7], params, delta=True)
        return cumulative, [output async for output in stream]

    cumulative, deltas = asyncio.run(run())
    final = cumulative[-1].outputs[0]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert [entry for d in deltas for entry in d.outputs[0].logprobs] == final.logprobs
    assert all(len(d.outputs[0].token_ids) < len(final.token_ids) for d in deltas[1:])  # never the whole list again
    assert deltas[-1].outputs[0].finish_reason == final.finish_reason == "length"
