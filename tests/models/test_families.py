"""Every registered family and rotary variant against Hugging Face transformers: greedy tokens
and their logprobs (1e-4), with prompts past every window and past
``original_max_position_embeddings``, through whole prompts, small prefill chunks with a
cached prefix, and memory tight enough to preempt, with n=2."""

from __future__ import annotations

import pytest

from pagedrs import LLM, SamplingParams
from tests.helpers.families import FAMILIES, hf_greedy_logprobs, save_family

NEW_TOKENS = 24
PROMPTS = [list(range(10, 47)), [7, 7, 7, 300, 12, 64, 19, 81, 44, 3, 99, 250, 31]]  # 37 and 13 tokens
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = save_family(request.param, directory)
    oracle = {tuple(prompt): hf_greedy_logprobs(model, prompt, NEW_TOKENS) for prompt in PROMPTS}
    return request.param, str(directory), oracle


def assert_matches(name: str, oracle, prompt: list[int], completion) -> None:
    tokens, logprobs, gaps = oracle[tuple(prompt)]
    ours = list(completion.token_ids)
    assert len(ours) == NEW_TOKENS
    for i, (token, expected) in enumerate(zip(tokens, logprobs)):
        if ours[i] != token:
            assert gaps[i] < 1e-3, f"{name}: diverged at token {i}: ours {ours[i]}, HF {token} (gap {gaps[i]:.2e})"
            return  # a near tie: the rest follows another path
        ours_logprob = completion.logprobs[i][token].logprob
        assert ours_logprob == pytest.approx(expected, abs=TOLERANCE), f"{name}: logprob of token {i}"


def generate(llm: LLM, prompts, n: int = 1):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1, n=n)
    return llm.generate(prompts, params, use_tqdm=False)


def test_whole_prompts_match_hugging_face(family):
    name, directory, oracle = family
    llm = LLM(directory)
    for prompt, output in zip(PROMPTS, generate(llm, PROMPTS)):
        assert_matches(name, oracle, prompt, output.outputs[0])
    assert llm.engine.scheduler.stats().num_used_blocks == 0


@pytest.mark.slow  # every family twice more: ~1 min in all
def test_chunks_prefix_hits_preemption_and_n2_match_hugging_face(family):
    name, directory, oracle = family
    llm = LLM(directory, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    # A prompt that shares the first 36 tokens of the long one: its blocks are cached.
    generate(llm, [PROMPTS[0][:36] + [5]])
    outputs = generate(llm, PROMPTS, n=2)
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_cache_hits >= 32
    for prompt, output in zip(PROMPTS, outputs):
        for completion in output.outputs:
            assert_matches(name, oracle, prompt, completion)
    # Preemption: room for a little over one sequence at a time.
    cache = llm.engine.runner.kv_caches[0][0]
    bytes_per_block = 2 * len(llm.engine.runner.kv_caches) * cache[0].numel() * cache.element_size()
    tight = LLM(directory, block_size=4, max_num_seqs=4, kv_cache_memory=24 * bytes_per_block)
    outputs = generate(tight, PROMPTS)
    assert tight.engine.scheduler.stats().num_preemptions_total > 0
    for prompt, output in zip(PROMPTS, outputs):
        assert_matches(name, oracle, prompt, output.outputs[0])
