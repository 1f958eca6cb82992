"""Tensor parallelism on this CPU: decode throughput of the default model with tp=1 against
tp=3 (SmolLM2-135M has 9 query heads and 3 KV heads, so 3 is its smallest split; 2 does not
divide them), and what the parallelism costs per step: the step broadcast from rank 0 (bytes,
time) and rank 0's time in the forward pass's collectives (all-reduce after each row-parallel
linear and the embedding, the logits gather), which includes waiting for the slowest rank.

``--smol-shaped DIR`` instead writes (once) and runs a random-weight float32 Llama of the
default model's size and shapes (576 hidden, 30 layers, 1536 intermediate, 49,152 tokens) but 8
query and 4 KV heads of 72, so that tp=2 divides it: one rank per core on this machine.

Every configuration runs in this process one after the other (rank 0 here, the other ranks
spawned), on an idle machine; greedy and sampled (temperature 1.0) requests; medians of
``--repeats`` runs.

    .venv/bin/python benches/bench_tensor_parallel.py [--sizes 1 3] [--batch 1 16] [--tokens 64]
    .venv/bin/python benches/bench_tensor_parallel.py --smol-shaped /tmp/smol-shaped --sizes 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from pagedrs import LLM, SamplingParams


class CollectiveTimer:
    """Wraps rank 0's all_reduce and gather to time them (the forward pass's collectives)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._originals = {name: getattr(dist, name) for name in ("all_reduce", "gather")}
        for name, original in self._originals.items():
            setattr(dist, name, self._timed(original))

    def _timed(self, original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def run(llm: LLM, batch: int, tokens: int, temperature: float) -> tuple[float, int]:
    """(seconds, engine steps) to generate ``tokens`` for each of ``batch`` prompts."""
    prompts = [f"Write a short story about a robot number {i}." for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True, seed=1)
    steps = 0
    original_step = llm.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return original_step()

    llm.engine.step = counted  # type: ignore[method-assign]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.engine.step = original_step  # type: ignore[method-assign]
    return seconds, steps


def smol_shaped(directory: str) -> str:
    """Writes the random-weight stand-in (see the module docstring) unless it is there."""
    import os

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import transformers

    from pagedrs.models.loader import load_tokenizer, resolve_model

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    load_tokenizer(resolve_model(None)).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--smol-shaped", default=None, metavar="DIR")
    args = parser.parse_args()
    model = smol_shaped(args.smol_shaped) if args.smol_shaped else None
    timer = CollectiveTimer()
    results = []
    for size in args.sizes:
        llm = LLM(model, kv_cache_memory="256MiB", tensor_parallel_size=size, quantization=args.quantization)
        group = llm.engine.parallel
        for batch in args.batch:
            for temperature in (0.0, 1.0):
                run(llm, batch, 8, temperature)  # warm-up
                samples = []
                for _ in range(args.repeats):
                    before = dict(group.broadcast_stats()) if group else None
                    timer.reset()
                    seconds, steps = run(llm, batch, args.tokens, temperature)
                    sample = {"seconds": seconds, "steps": steps, "collective_s": timer.seconds}
                    if group is not None and before is not None:
                        after = group.broadcast_stats()
                        sample["broadcast_s"] = after["seconds"] - before["seconds"]
                        sample["broadcast_bytes"] = after["bytes"] - before["bytes"]
                    samples.append(sample)
                best = sorted(samples, key=lambda s: s["seconds"])[len(samples) // 2]  # the median run
                steps = best["steps"]
                row = {
                    "tp": size,
                    "batch": batch,
                    "temperature": temperature,
                    "tok_s": round(batch * args.tokens / statistics.median(s["seconds"] for s in samples), 1),
                    "step_ms": round(best["seconds"] / steps * 1e3, 2),
                    "collectives_ms_per_step": round(best["collective_s"] / steps * 1e3, 2),
                }
                if "broadcast_s" in best:
                    row["broadcast_ms_per_step"] = round(best["broadcast_s"] / steps * 1e3, 3)
                    row["broadcast_bytes_per_step"] = round(best["broadcast_bytes"] / steps)
                print(json.dumps(row), flush=True)
                results.append(row)
        llm.shutdown()
    print(f"threads: torch {torch.get_num_threads()} in rank 0 after the last run")


if __name__ == "__main__":
    main()
