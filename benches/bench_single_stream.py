"""Single-stream decode of the default model: tokens per second over 128 generated tokens (prefill
included), greedy and at temperature 1.0, the median of 3 runs each.

Run on an idle machine, in each tree to compare (the label is printed with the result):

    PYTHONPATH=python .venv/bin/python benches/bench_single_stream.py LABEL
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from pagedrs import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NEW_TOKENS = 128


def main() -> None:
    torch.set_num_threads(2)
    llm = LLM(kv_cache_memory="512MiB")
    llm.generate([PROMPT], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    settings = {
        "greedy": SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        "t1.0": SamplingParams(temperature=1.0, seed=1, max_tokens=NEW_TOKENS, ignore_eos=True),
    }
    result: dict[str, object] = {"label": sys.argv[1] if len(sys.argv) > 1 else ""}
    for name, params in settings.items():
        result[name] = median_rate(llm, PROMPT, params)
    print(json.dumps(result))


def median_rate(llm: LLM, prompt: str | list[int], params: SamplingParams, runs: int = 3) -> float:
    """Generated tokens per second of one stream (prefill included), the median of ``runs``."""
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        rates.append(params.max_tokens / (time.perf_counter() - start))
    return round(statistics.median(rates), 2)


if __name__ == "__main__":
    main()
