"""Hugging Face transformers as the oracle for greedy decoding:
- `hf_greedy`: argmax tokens from transformers' own model and KV cache.
- `assert_same_or_near_tie`: equal tokens, or a divergence where transformers' top two logits tie.
- `run`: our greedy tokens for `PROMPTS`-like prompts, `NEW_TOKENS` each."""

from __future__ import annotations

import warnings

import torch

from pagedrs import LLM, SamplingParams

NEW_TOKENS = 32
PROMPTS = [
    [5, 17, 33, 2, 9],
    list(range(10, 47)),
    [7, 7, 7, 300, 12, 64, 19, 81, 44, 3, 99, 250, 31],
]


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Plain argmax decoding with transformers' own model and KV cache: no logits processors
    (``generate`` would mask EOS under ``min_new_tokens``), matching ``ignore_eos``."""
    tokens = []
    # `past_key_values` works across transformers 5.x; newer releases call it `cache`.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            tokens.append(int(result.logits[0, -1].argmax()))
            result = model(torch.tensor([[tokens[-1]]]), past_key_values=result.past_key_values, use_cache=True)
    return tokens


def assert_same_or_near_tie(model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Equal tokens, or a first divergence where HF's top two logits are within 1e-3."""
    if ours == theirs:
        return
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs[:at]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-3, f"diverged at token {at}: ours {ours[at]}, HF {theirs[at]}, logit gap {gap}"


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
