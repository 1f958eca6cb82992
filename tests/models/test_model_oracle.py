"""Greedy output equals Hugging Face transformers token for token, for each architecture,
however the scheduler cuts the batch: whole prompts, small chunks, a shared cached prefix,
and memory so tight that requests are preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, SamplingParams
from tests.helpers.checkpoints import TINY, save_word_tokenizer
from tests.helpers.oracle import NEW_TOKENS, PROMPTS, assert_same_or_near_tie, hf_greedy, run


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 8, "max_num_seqs": 4},
        # 20 blocks of 4 tokens at 512 bytes a token (2 layers, K and V, 2 KV heads of 16
        # float32 values): the three sequences grow to 151 tokens, 38 blocks.
        {"block_size": 4, "kv_cache_memory": 20 * 4 * 512},
    ],
    ids=["whole-prompts", "small-chunks", "tight-memory"],
)
def test_greedy_matches_hugging_face(tiny_checkpoint, settings):
    architecture, directory, hf_model = tiny_checkpoint
    llm = LLM(directory, **settings)
    ours = run(llm, PROMPTS)
    for prompt, tokens in zip(PROMPTS, ours):
        assert len(tokens) == NEW_TOKENS
        assert_same_or_near_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, NEW_TOKENS))
    stats = llm.engine.scheduler.stats()
    if "kv_cache_memory" in settings:
        assert stats.num_preemptions_total > 0
    assert stats.num_used_blocks == 0


def test_shared_prefix_is_reused_and_still_exact(tiny_checkpoint):
    architecture, directory, hf_model = tiny_checkpoint
    llm = LLM(directory, block_size=4)
    prefix = list(range(100, 124))
    prompts = [prefix + [1, 2, 3], prefix + [9], prefix + [40, 41]]
    run(llm, prompts[:1])
    ours = run(llm, prompts[1:])
    assert llm.engine.scheduler.stats().prefix_cache_hits >= 2 * 24
    for prompt, tokens in zip(prompts[1:], ours):
        assert_same_or_near_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, NEW_TOKENS))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_mistral_sliding_window_matches_hugging_face(tmp_path):
    import transformers

    torch.manual_seed(7)
    config = transformers.MistralConfig(**TINY, sliding_window=8)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(8)
    hf_model.save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path, TINY["vocab_size"])
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = PROMPTS[1:]  # 37 and 13 tokens: far past the window of 8
    for prompt, tokens in zip(prompts, run(llm, prompts)):
        assert_same_or_near_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, NEW_TOKENS))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_on_the_paged_cache(tiny_checkpoint, dtype):
    architecture, directory, hf_model = tiny_checkpoint
    llm = LLM(directory, dtype=dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    tokens = run(llm, PROMPTS[:2])
    assert [len(t) for t in tokens] == [NEW_TOKENS, NEW_TOKENS]
    # Close to float32: the first greedy token agrees with Hugging Face's.
    assert [t[0] for t in tokens] == [hf_greedy(hf_model, p, 1)[0] for p in PROMPTS[:2]]


def test_prompt_logprobs_match_hugging_face_across_chunks(tiny_checkpoint):
    architecture, directory, hf_model = tiny_checkpoint
    llm = LLM(directory, max_num_batched_tokens=8, max_num_seqs=4, block_size=4)
    prompt = PROMPTS[1]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # cache it
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
        assert len(entry) >= 2
