"""Structured outputs' cost on the default model: decode throughput of JSON-schema-constrained
requests against unconstrained ones at batch 1 and 32, side by side in one run, plus what the
constraint costs by itself (compile cold and cached, mask time per step).

Both sides generate exactly ``--tokens`` tokens per request: the schema asks for one long
string (``minLength`` past what the tokens can hold), so the constrained request never ends
early, and the unconstrained one runs with ``ignore_eos``. The same prompts, greedy and
sampled (temperature 1.0). Throughput = generated tokens / wall time of the whole run
(prefill included, the same on both sides).

    .venv/bin/python benches/bench_structured.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import pagedrs
from pagedrs import LLM, SamplingParams
from pagedrs.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "summary": {"type": "string", "minLength": 2000},
    },
    "required": ["title", "year", "summary"],
    "additionalProperties": False,
}
"""A typical extraction schema whose last field never ends within the token budget."""
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, int]:
    """``(seconds, generated tokens, steps)`` for all prompts at once."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    steps = tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens += sum(len(choice.token_ids) for choice in output.outputs)
        steps += 1
    return time.perf_counter() - start, tokens, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(kv_cache_memory="512MiB", max_num_seqs=64, seed=0)
    engine = llm.engine
    print(
        f"pagedrs {pagedrs.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, {engine.device} {engine.dtype}"
    )
    constraint = StructuredOutputsParams(json=SCHEMA)
    results = []
    for batch in (1, 32):
        prompts = [
            llm.apply_chat_template([{"role": "user", "content": f"Describe film number {i} as JSON."}])
            for i in range(batch)
        ]
        for temperature in (0.0, 1.0):
            plain = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True, seed=1)
            constrained = SamplingParams(
                temperature=temperature, max_tokens=args.tokens, seed=1, structured_outputs=constraint
            )
            run(llm, prompts, plain)  # warm-up (and the grammar compiled once)
            run(llm, prompts, constrained)
            rates: dict[str, list[float]] = {"plain": [], "constrained": []}
            masks_before = engine.structured_output_stats()
            constrained_steps = 0
            for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
                for name, params in (("plain", plain), ("constrained", constrained)):
                    seconds, tokens, steps = run(llm, prompts, params)
                    if tokens != batch * args.tokens:
                        raise RuntimeError(f"{name}: {tokens} tokens, expected {batch * args.tokens}")
                    rates[name].append(tokens / seconds)
                    constrained_steps += steps if name == "constrained" else 0
            masks_after = engine.structured_output_stats()
            plain_rate, constrained_rate = statistics.median(rates["plain"]), statistics.median(rates["constrained"])
            mask_ms = 1e3 * (masks_after.mask_seconds - masks_before.mask_seconds) / constrained_steps
            results.append(
                {
                    "batch": batch,
                    "temperature": temperature,
                    "unconstrained_tok_s": round(plain_rate, 1),
                    "constrained_tok_s": round(constrained_rate, 1),
                    "ratio": round(constrained_rate / plain_rate, 3),
                    "mask_ms_per_step": round(mask_ms, 3),
                }
            )
            print(json.dumps(results[-1]))
    grammars = engine.grammars
    spec = json.dumps(TYPICAL_SCHEMA, sort_keys=True)
    before = grammars.compile_seconds_total
    grammars.compile("json_schema", spec)
    cold_ms = 1e3 * (grammars.compile_seconds_total - before)
    start = time.perf_counter()
    grammars.compile("json_schema", spec)
    cached_us = 1e6 * (time.perf_counter() - start)
    print(json.dumps({"typical_schema_compile_cold_ms": round(cold_ms, 3), "cached_compile_us": round(cached_us, 1)}))
    sample = llm.generate(
        llm.apply_chat_template([{"role": "user", "content": "Describe the film Casablanca as JSON."}]),
        SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=TYPICAL_SCHEMA)),
        use_tqdm=False,
    )
    print("default model, typical schema, greedy:", sample[0].outputs[0].text)


if __name__ == "__main__":
    main()
