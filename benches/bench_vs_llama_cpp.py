"""pagedrs against llama.cpp (llama-cpp-python) on the default model's GGUF file, the same
file and the same 2 threads, greedy and temperature 1.0 (no top-k / top-p / min-p on either
side), EOS suppressed on both so every request makes exactly the tokens it asks for; each
engine loaded once in its own process, one after the other on an idle machine.

- Single stream (default): 128 generated tokens after a fixed prompt (prefill included in the
  time), tokens per second over the whole call, median of ``--repeats`` runs.
- ``--mixed N``: N requests of mixed lengths (seeded: prompts of 16-64 random token ids,
  8-256 new tokens each), as a user with a batch of work runs them: pagedrs takes them all at
  once (continuous batching), llama.cpp one after the other (llama-cpp-python serves one
  sequence). Useful tokens per second over the whole batch, median of ``--repeats`` runs.

llama-cpp-python builds llama.cpp from source and is not one of pagedrs's dependencies;
install it into a separate environment and name its Python:

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python
    .venv/bin/python benches/bench_vs_llama_cpp.py --llama-python /tmp/llvenv/bin/python [--mixed 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NUM_TOKENS = 128

# argv: model path, repeats, threads, then the jobs as JSON: [[prompt (text or token ids), new tokens], ...]
LLAMA_CPP = textwrap.dedent(
    """
    import json, statistics, sys, time
    import llama_cpp
    from llama_cpp import Llama

    path, jobs = sys.argv[1], json.loads(sys.argv[4])
    repeats, threads = int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    # every end-of-generation token (three in SmolLM2's vocabulary), not only EOS: a random prompt can end on any
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    no_eos = {t: float("-inf") for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    rows = []
    for temperature in (0.0, 1.0):
        llm(jobs[0][0], max_tokens=4, temperature=temperature)  # warm-up
        times = []
        for i in range(repeats):
            start = time.perf_counter()
            for prompt, num_tokens in jobs:  # one request at a time
                llm.reset()  # no prompt reuse between requests or runs: each pays its prefill
                out = llm(prompt, max_tokens=num_tokens, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                          logit_bias=no_eos, seed=i)
                # llama-cpp-python 0.3.36 once reported one token past max_tokens (117 for 116, the
                # Zen 5 VM, 2026-12-06); the rate counts only the tokens asked for
                assert out["usage"]["completion_tokens"] in (num_tokens, num_tokens + 1), out["usage"]
            times.append(time.perf_counter() - start)
        total = sum(num_tokens for _, num_tokens in jobs)
        rows.append({"engine": "llama.cpp (llama-cpp-python)", "temperature": temperature,
                     "tok_s": total / statistics.median(times), "runs_s": times})
    print(json.dumps(rows))
    """
)


def make_jobs(mixed: int) -> list[tuple[str | list[int], int]]:
    """The requests of one run: the fixed prompt alone, or ``mixed`` seeded mixed-length ones
    (the `mixed-lengths` preset's lengths, drawn by `pagedrs bench`'s own generator; token ids
    from 1000 to 40000, as recorded in docs/bench)."""
    if mixed == 0:
        return [(PROMPT, NUM_TOKENS)]
    from pagedrs.bench.workloads import PRESETS, Lengths, generate

    preset = PRESETS["mixed-lengths"]
    specs = generate(
        mixed, Lengths.parse(preset.input_len), Lengths.parse(preset.output_len), seed=0, token_range=(1000, 40000)
    )
    return [(spec.prompt, spec.output_len) for spec in specs]


def pagedrs_rows(jobs: list[tuple[str | list[int], int]], repeats: int, threads: int, activations: str) -> list[dict]:
    import statistics
    import time

    import torch

    from pagedrs import LLM, SamplingParams

    torch.set_num_threads(threads)
    # No prefix reuse: each run pays its prefill. 1 GiB of KV holds a whole mixed batch.
    llm = LLM(kv_cache_memory="1GiB", enable_prefix_caching=False, cpu_activation_quantization=activations)
    prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p, _ in jobs]
    total = sum(num_tokens for _, num_tokens in jobs)
    rows = []
    for temperature in (0.0, 1.0):
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=temperature), use_tqdm=False)
        times = []
        for i in range(repeats):
            params = [
                SamplingParams(max_tokens=num_tokens, temperature=temperature, ignore_eos=True, seed=i * len(jobs) + j)
                for j, (_, num_tokens) in enumerate(jobs)
            ]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)  # all at once
            times.append(time.perf_counter() - start)
            assert [len(out.outputs[0].token_ids) for out in outputs] == [n for _, n in jobs]
        rows.append(
            {
                "engine": f"pagedrs (quantization={llm.engine.config.quantization}, activations={activations})",
                "temperature": temperature,
                "tok_s": total / statistics.median(times),
                "runs_s": times,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--activations",
        default="none",
        help="pagedrs's cpu_activation_quantization, or several comma-separated (none,int8): one run each",
    )
    parser.add_argument("--mixed", type=int, default=0, help="N mixed-length requests (0: one stream)")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    jobs = make_jobs(args.mixed)
    if args.in_process:
        print(json.dumps(pagedrs_rows(jobs, args.repeats, args.threads, args.activations)))
        return
    from pagedrs.models.loader import default_model_path

    ours = []
    for activations in args.activations.split(","):
        run = subprocess.run(
            [
                sys.executable,
                __file__,
                "--in-process",
                "--llama-python",
                "-",
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
                "--activations",
                activations,
                "--mixed",
                str(args.mixed),
            ],
            check=True,
            stdout=subprocess.PIPE,  # the child's errors go to this stderr
            text=True,
        )
        ours += json.loads(run.stdout.strip().splitlines()[-1])
    theirs = subprocess.run(
        [
            args.llama_python,
            "-c",
            LLAMA_CPP,
            default_model_path(),
            str(args.repeats),
            str(args.threads),
            json.dumps(jobs),
        ],
        check=True,
        stdout=subprocess.PIPE,  # the child's errors go to this stderr
        text=True,
    )
    reference = json.loads(theirs.stdout.strip().splitlines()[-1])
    for row in ours + reference:
        row["tok_s"] = round(row["tok_s"], 1)
        row["runs_s"] = [round(t, 3) for t in row["runs_s"]]
        print(json.dumps(row))
    for row in ours:
        base = next(ref["tok_s"] for ref in reference if ref["temperature"] == row["temperature"])
        print(f"{row['engine']}, temperature {row['temperature']}: / llama.cpp = {row['tok_s'] / base:.2f}x")


if __name__ == "__main__":
    main()
