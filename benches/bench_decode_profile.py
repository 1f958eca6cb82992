"""Where a default-model decode step goes: attention against the rest, per backend.

SmolLM2-135M-Instruct (float32, 2 threads), B requests with prompts of ~P tokens, all
decoding; `--steps` decode steps timed per attention backend, each split by wrapping every
layer's attention call (KV write plus attention) and the sampler. Medians.

    .venv/bin/python benches/bench_decode_profile.py [--batch 64] [--context 500] [--backends cpu,torch]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedrs import SamplingParams
from pagedrs.engine.llm_engine import LLMEngine


def measure(backend: str, batch: int, context: int, steps: int) -> dict:
    engine = LLMEngine(
        kv_cache_memory="2GiB", max_num_seqs=batch, max_num_batched_tokens=4096, attention_backend=backend, seed=0
    )
    seconds = {"attention": 0.0}
    # Every layer attends through the step's metadata object: time its `attend`.
    metadata_class = engine.runner.attention_backend.metadata
    original = metadata_class.attend

    def timed_attend(meta, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(meta, *args, **kwargs)
        finally:
            seconds["attention"] += time.perf_counter() - start

    metadata_class.attend = timed_attend
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", torch.randint(1000, 40000, (context,), generator=generator).tolist(), params)
    while engine.scheduler.num_waiting or engine.last_schedule is None or engine.last_schedule.num_prefill_tokens:
        engine.step()
    totals, attention = [], []
    for _ in range(steps):
        seconds["attention"] = 0.0
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
        attention.append(seconds["attention"])
        assert engine.last_schedule.num_decode_tokens == batch
    metadata_class.attend = original
    step, attend = statistics.median(totals), statistics.median(attention)
    return {
        "backend": engine.runner.attention_backend.name,
        "step_ms": step * 1e3,
        "attention_ms": attend * 1e3,
        "attention_share": attend / step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backends", default="cpu,torch")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, context ~{args.context}")
    print(f"{'backend':<8} {'step ms':>8} {'attention ms':>13} {'share':>6}")
    for backend in args.backends.split(","):
        result = measure(backend, args.batch, args.context, args.steps)
        print(
            f"{result['backend']:<8} {result['step_ms']:>8.1f} {result['attention_ms']:>13.1f} "
            f"{result['attention_share']:>6.1%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
