"""The CPU's approximate options against the exact path on the default model, side by side in
one process: int8 activations (``cpu_activation_quantization="int8"``) and a 16-bit or fp8 KV
cache (``kv_cache_dtype="bfloat16"`` / ``"float16"`` / ``"fp8"``): what each costs in accuracy
and buys in speed.

Accuracy, over a fixed text (the first ``TEXT_TOKENS`` tokens of this repository's README, one
prompt, teacher-forced): the perplexity of each path, the mean and largest change of the text
tokens' logprobs against the exact path, and how often the two paths' most likely next token
agree; then greedy agreement: 8 prompts, 128 tokens each, the tokens each path generates before
it differs from the exact one.

Speed: single-stream decode (128 tokens, prefill included; greedy and at temperature 1.0), a
batch of 64 requests decoding 64 tokens each after short prompts (useful tokens per second,
prefill included), medians of 3, and the decode rate of a batch of 64 after 500-token prompts
(attention's share grows with the context), one run (the prefills take minutes).

    PYTHONPATH=python .venv/bin/python benches/bench_cpu_precision.py [--variants int8,bf16-kv,fp16-kv,fp8-kv]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from pagedrs import LLM, SamplingParams

TEXT_TOKENS = 512
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a paged KV cache works.",
    "List three uses of a hash map.",
    "What is the capital of France, and why?",
    "Describe the water cycle to a child.",
    "Give a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Hamlet.",
]


def text_logprobs(llm: LLM, token_ids: list[int]) -> list[dict[int, float]]:
    """Each position's top-20 logprobs (the text's own token always among them)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=20, temperature=0)
    output = llm.generate([token_ids], params, use_tqdm=False)[0]
    return [{t: lp.logprob for t, lp in entry.items()} if entry else {} for entry in output.prompt_logprobs]


def accuracy(exact: LLM, other: LLM) -> dict[str, object]:
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    token_ids = exact.get_tokenizer().encode(readme)[:TEXT_TOKENS]
    ours, theirs = text_logprobs(exact, token_ids), text_logprobs(other, token_ids)
    deltas, agree, nll_exact, nll_other = [], 0, 0.0, 0.0
    for position in range(1, len(token_ids)):
        token = token_ids[position]
        a, b = ours[position], theirs[position]
        nll_exact -= a[token]
        nll_other -= b[token]
        deltas.append(abs(a[token] - b[token]))
        agree += max(a, key=lambda t: a[t]) == max(b, key=lambda t: b[t])
    positions = len(token_ids) - 1
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    greedy = [exact.generate(PROMPTS, params, use_tqdm=False), other.generate(PROMPTS, params, use_tqdm=False)]
    shared = []
    for left, right in zip(*greedy):
        a, b = left.outputs[0].token_ids, right.outputs[0].token_ids
        shared.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    return {
        "perplexity_exact": round(math.exp(nll_exact / positions), 4),
        "perplexity_other": round(math.exp(nll_other / positions), 4),
        "mean_abs_logprob_change": round(statistics.mean(deltas), 5),
        "max_abs_logprob_change": round(max(deltas), 4),
        "top1_agreement": round(agree / positions, 4),
        "greedy_tokens_before_divergence": shared,
        "greedy_identical_prompts": sum(s == 128 for s in shared),
    }


VARIANTS = {
    "int8": {"cpu_activation_quantization": "int8"},
    "bf16-kv": {"kv_cache_dtype": "bfloat16"},
    "fp16-kv": {"kv_cache_dtype": "float16"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
}


def single_stream(llm: LLM, params: SamplingParams) -> float:
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
        rates.append(params.max_tokens / (time.perf_counter() - start))
    return round(statistics.median(rates), 2)


def batch(llm: LLM) -> float:
    """Useful tokens per second of 64 requests of 64 new tokens (temperature 1.0) after short
    prompts, prefill included."""
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=64, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(64)]
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(64 * 64 / (time.perf_counter() - start))
    return round(statistics.median(rates), 1)


def long_context_decode(llm: LLM, prompt_tokens: int = 500) -> float:
    """Decode tokens per second of 64 requests after ``prompt_tokens`` distinct tokens of README
    text each: the time of 64 new tokens minus the time of 1 (the prefill), one run each."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    ids = llm.get_tokenizer().encode(readme)
    prompts: list = [ids[i : i + prompt_tokens] for i in range(64)]

    def seconds(new_tokens: int) -> float:  # one run each: 64 prefills of 500 tokens take minutes
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return round(64 * 63 / (seconds(64) - seconds(1)), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="int8,bf16-kv,fp16-kv", help=f"among {', '.join(VARIANTS)}")
    args = parser.parse_args()
    torch.set_num_threads(2)
    names = [name for name in args.variants.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose among {', '.join(VARIANTS)}")
    llms = {"exact": LLM(kv_cache_memory="3GiB", enable_prefix_caching=False)}
    for name in names:
        llms[name] = LLM(kv_cache_memory="3GiB", enable_prefix_caching=False, **VARIANTS[name])
    for llm in llms.values():
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    result: dict[str, object] = {"accuracy": {name: accuracy(llms["exact"], llms[name]) for name in names}}
    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=128, ignore_eos=True)
    for name, llm in llms.items():
        result[name] = {
            "single_greedy_tok_s": single_stream(llm, greedy),
            "single_t1.0_tok_s": single_stream(llm, sampled),
            "batch64_t1.0_tok_s": batch(llm),
            "batch64_decode_after_500_t1.0_tok_s": long_context_decode(llm),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
