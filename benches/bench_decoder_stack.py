"""The compiled decoder stack (``cpu/decoder_stack.cpp``) against the Python layers it replaces,
side by side in one process on the default model (GGUF weights kept packed, 2 threads):

- one stream: 128 greedy tokens after a short prompt (prefill included), tokens per second,
  and the median forward pass of its decode steps;
- a batch of ``--batch`` sequences decoding (prompts of 40 tokens): the median engine step.

Each measurement alternates stack / layers ``--repeats`` times and reports medians.

    .venv/bin/python benches/bench_decoder_stack.py [--batch 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedrs import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def single_stream(llm: LLM, use_stack: bool, stack) -> tuple[float, float]:
    """(tokens per second, median forward ms of the run's steps)."""
    runner, model = llm.engine.runner, llm.engine.runner.model
    runner.cpu_stack = stack if use_stack else None
    forward_seconds: list[float] = []
    original = model.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            forward_seconds.append(time.perf_counter() - start)

    model.forward = timed
    try:
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        del model.forward
        runner.cpu_stack = stack
    return 128 / elapsed, statistics.median(forward_seconds[1:]) * 1e3  # the first is the prefill


def batch_steps(llm: LLM, use_stack: bool, stack, batch: int, steps: int = 8) -> float:
    """Median ms of an engine step with ``batch`` sequences decoding."""
    engine = llm.engine
    engine.runner.cpu_stack = stack if use_stack else None
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{use_stack}-{i}", torch.randint(1000, 40000, (40,), generator=generator).tolist(), params)
    while engine.scheduler.num_waiting or engine.last_schedule is None or engine.last_schedule.num_prefill_tokens:
        engine.step()
    median = median_step_ms(engine, steps)
    engine.runner.cpu_stack = stack
    return median


def median_step_ms(engine, steps: int) -> float:
    """The median of ``steps`` engine steps in ms; then the engine's requests run to their end."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = LLM(kv_cache_memory="1GiB", enable_prefix_caching=False, max_num_seqs=max(args.batch, 1))
    stack = llm.engine.runner.cpu_stack
    if stack is None:
        raise SystemExit("the decoder stack does not run here (see pagedrs.models.cpu_stack.why_unsupported)")
    llm.generate([PROMPT], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    rows: dict[str, dict[str, list[float]]] = {"stack": {}, "layers": {}}
    for _ in range(args.repeats):
        for name in rows:
            tok_s, forward_ms = single_stream(llm, name == "stack", stack)
            rows[name].setdefault("single_stream_tok_s", []).append(tok_s)
            rows[name].setdefault("decode_forward_ms", []).append(forward_ms)
            step_ms = batch_steps(llm, name == "stack", stack, args.batch)
            rows[name].setdefault(f"batch{args.batch}_step_ms", []).append(step_ms)
    for name, measured in rows.items():
        print(json.dumps({"path": name, **{key: round(statistics.median(v), 2) for key, v in measured.items()}}))


if __name__ == "__main__":
    main()
