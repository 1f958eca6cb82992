"""Decode steps of the default model with the decoder stack's layers in one parallel region (the
default for steps of up to 8 rows: cpu/decoder_stack.cpp's SharedTeam) against one region per
linear and attention (`CpuDecoderStack.set_one_region(False)`), alternated in one process.

For each activation path (exact, int8) and each batch (1 sequence, and ``--batches``
sequences decoding together): the median `LLMEngine.step` and the median decoder-stack call of
``--steps`` steps, greedy and at temperature 1.0, ``--rounds`` rounds switching between the two
every round; medians over rounds and the ratio pooled / one region.

    .venv/bin/python benches/bench_one_region.py [--threads 2] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
from bench_bandwidth_bound import PROMPT_TOKENS, SETTINGS, step_ms
from bench_decoder_stack import median_step_ms

from pagedrs import LLM, SamplingParams
from pagedrs.envinfo import environment
from pagedrs.kernels import cpu as cpu_kernels


def batch_step_ms(llm: LLM, params: SamplingParams, batch: int, steps: int) -> dict[str, float]:
    """The median step of ``batch`` sequences decoding together (prompts of 18 tokens, each a
    little different), in ms."""
    engine = llm.engine
    decode = dataclasses.replace(params, max_tokens=steps + 8)
    for i in range(batch):
        engine.add_request(f"b{i}", [t + i for t in PROMPT_TOKENS], decode)
    for _ in range(4):  # the prefills and a few steps before timing
        engine.step()
    return {"step": median_step_ms(engine, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activations", default="none,int8", help="cpu_activation_quantization values")
    parser.add_argument("--batches", default="4,8", help="batch sizes besides one sequence")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [1] + [int(b) for b in args.batches.split(",") if b]
    rows = []
    for activations in args.activations.split(","):
        llm = LLM(kv_cache_memory="512MiB", cpu_activation_quantization=activations)
        stack = llm.engine.runner.cpu_stack
        assert stack is not None, "the default model runs the compiled stack"
        llm.generate([{"prompt_token_ids": PROMPT_TOKENS}], SamplingParams(max_tokens=8), use_tqdm=False)
        for batch in batches:
            for name, params in SETTINGS.items():
                runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
                for round_index in range(args.rounds):
                    order = (True, False) if round_index % 2 == 0 else (False, True)
                    for one_region in order:
                        stack.set_one_region(one_region)
                        before = stack.one_region_steps
                        if batch == 1:
                            runs[one_region].append(step_ms(llm, params, args.steps))
                        else:
                            runs[one_region].append(batch_step_ms(llm, params, batch, args.steps))
                        assert (stack.one_region_steps > before) == one_region
                stack.set_one_region(True)
                row = {"activations": activations, "batch": batch, "setting": name}
                for one_region, label in ((True, "one_region"), (False, "pooled")):
                    row[f"{label}_step_ms"] = round(statistics.median(r["step"] for r in runs[one_region]), 3)
                    if batch == 1:
                        row[f"{label}_stack_ms"] = round(statistics.median(r["stack"] for r in runs[one_region]), 3)
                row["step_ratio"] = round(row["pooled_step_ms"] / row["one_region_step_ms"], 3)
                rows.append(row)
                in_stack = (
                    f"  stack's call {row['pooled_stack_ms']:.3f} -> {row['one_region_stack_ms']:.3f} ms"
                    if batch == 1
                    else ""
                )
                print(
                    f"{activations:<5} batch {batch:>2} {name:<6} step pooled {row['pooled_step_ms']:.3f} -> "
                    f"one region {row['one_region_step_ms']:.3f} ms (x{row['step_ratio']:.3f}){in_stack}",
                    flush=True,
                )
        del llm
    record = {
        "environment": environment(),
        "kernels": cpu_kernels.describe(),
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
        "rows": rows,
    }
    print(record["kernels"])
    print(record["environment"]["cpu"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
