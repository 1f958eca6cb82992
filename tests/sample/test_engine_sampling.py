"""Sampling through the whole engine on a tiny random Llama: seeds reproduce alone, in large
batches and across preemption; a greedy row mixed into a sampled batch stays identical to
HF; the columnar step boundary keeps n > 1, stop strings, aborts and penalties right, and
every block and penalty slot is free again at the end."""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, SamplingParams
from tests.helpers.oracle import hf_greedy

SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, 320, (int(torch.randint(3, 30, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(count)
    ]


def _others(count: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.95, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.1, min_p=0.05, presence_penalty=0.5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, logprobs=2, max_tokens=20, ignore_eos=True),
    ]
    return [kinds[i % len(kinds)] for i in range(count)]


def _seeded_tokens(llm: LLM, prompt: list[int], num_others: int) -> list[int]:
    prompts = _prompts(num_others, seed=num_others)
    params = _others(num_others)
    middle = num_others // 2
    prompts.insert(middle, prompt)
    params.insert(middle, SEEDED)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs[middle].outputs[0].token_ids


@pytest.mark.parametrize("num_others", [15, 255])
def test_a_seeded_request_gives_the_same_tokens_alone_or_in_a_batch(tiny_llama, num_others):
    llm = LLM(tiny_llama, max_num_seqs=256, kv_cache_memory="64MiB", max_num_batched_tokens=4096)
    prompt = [5, 17, 33, 2, 9, 41]
    alone = llm.generate([prompt], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 24
    assert _seeded_tokens(llm, prompt, num_others) == alone
    stats = llm.engine.scheduler.stats()
    assert stats.num_used_blocks == 0 and llm.engine.sampler.penalties.num_slots_in_use == 0


def test_a_seeded_request_gives_the_same_tokens_across_preemption(tiny_llama):
    prompt = [5, 17, 33, 2, 9, 41]
    alone = LLM(tiny_llama).generate([prompt], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    # 24 blocks of 4 tokens for 16 sequences that grow to ~50 tokens each: many preemptions.
    tight = LLM(tiny_llama, block_size=4, kv_cache_memory=24 * 4 * 512, max_num_seqs=16)
    assert _seeded_tokens(tight, prompt, 15) == alone
    stats = tight.engine.scheduler.stats()
    assert stats.num_preemptions_total > 0 and stats.num_used_blocks == 0


def test_a_wide_seeded_request_gives_the_same_choices_under_the_fair_share(tiny_llama):
    """n = 8 beside 15 others with max_seqs_per_request=2: six choices wait their turn (forked,
    then requeued to recompute from the prefix cache), and each gives what it gives alone."""
    wide = SamplingParams(
        n=8, temperature=0.9, seed=77, max_tokens=20, ignore_eos=True, logprobs=1, repetition_penalty=1.2
    )
    prompt = [5, 17, 33, 2, 9, 41, 8, 3, 12]

    def choices(llm: LLM, num_others: int) -> list[tuple[list[int], list[float]]]:
        prompts = _prompts(num_others, seed=5)
        params = _others(num_others)
        outputs = llm.generate([*prompts[:1], prompt, *prompts[1:]], [*params[:1], wide, *params[1:]], use_tqdm=False)
        return [
            (list(choice.token_ids), [entry[token].logprob for token, entry in zip(choice.token_ids, choice.logprobs)])
            for choice in outputs[min(1, num_others)].outputs
        ]

    alone = choices(LLM(tiny_llama, block_size=4, kv_cache_memory="16MiB"), 0)
    shared = LLM(tiny_llama, block_size=4, kv_cache_memory="16MiB", max_seqs_per_request=2)
    beside_others = choices(shared, 15)
    assert [tokens for tokens, _ in beside_others] == [tokens for tokens, _ in alone]
    for (_, got), (_, want) in zip(beside_others, alone):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    stats = shared.engine.scheduler.stats()
    assert stats.num_fair_share_requeues_total >= 6
    assert stats.num_used_blocks == 0 and shared.engine.sampler.penalties.num_slots_in_use == 0


def test_greedy_rows_in_a_sampled_batch_match_hugging_face(tiny_llama):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    llm = LLM(tiny_llama, max_num_seqs=64)
    prompts = _prompts(24, seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)
        for i in range(24)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i in range(0, 24, 3):
        assert outputs[i].outputs[0].token_ids == hf_greedy(hf_model, prompts[i], 16)


def test_n_choices_stop_strings_and_aborts_keep_every_choice_and_free_everything(tiny_llama):
    llm = LLM(tiny_llama, block_size=4)
    engine = llm.engine
    # Token i detokenizes to "wi": a stop string on a word ends choices that sample it.
    engine.add_request(
        "many",
        [5, 6, 7, 8, 9],
        SamplingParams(
            n=4,
            temperature=1.5,
            max_tokens=40,
            seed=3,
            stop=[f"w{i}" for i in range(100, 140)],
            ignore_eos=True,
            frequency_penalty=0.3,
        ),
    )
    engine.add_request("gone", [5, 6, 7], SamplingParams(n=2, temperature=1.0, max_tokens=40, ignore_eos=True))
    engine.add_request("greedy", [9, 9, 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
        if steps == 3:
            engine.abort_request("gone")
    assert set(finished) == {"many", "greedy"}
    many = finished["many"]
    assert [choice.index for choice in many.outputs] == [0, 1, 2, 3]
    for choice in many.outputs:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "length":
            assert len(choice.token_ids) == 40
        if choice.finish_reason == "stop":
            assert choice.stop_reason.startswith("w1") and not choice.text.endswith(choice.stop_reason)
    assert "stop" in {choice.finish_reason for choice in many.outputs}  # seeded: it does happen
    assert len(finished["greedy"].outputs[0].token_ids) == 10
    assert engine.scheduler.stats().num_used_blocks == 0
    assert engine.sampler.penalties.num_slots_in_use == 0
