"""One stream, the default model's GGUF file, pagedrs against llama.cpp (llama-cpp-python) on
the same file and the same 2 threads: 128 generated tokens after a fixed prompt (prefill
included in the time), greedy and temperature 1.0 (no top-k / top-p / min-p on either side),
EOS suppressed on both so every run makes exactly 128 tokens; tokens per second over the
whole call, median of ``--repeats`` runs, each engine loaded once in its own process, one
after the other on an idle machine.

llama-cpp-python builds llama.cpp from source and is not one of pagedrs's dependencies;
install it into a separate environment and name its Python:

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python
    .venv/bin/python benches/bench_vs_llama_cpp.py --llama-python /tmp/llvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NUM_TOKENS = 128

LLAMA_CPP = textwrap.dedent(
    """
    import json, statistics, sys, time
    from llama_cpp import Llama

    path, prompt = sys.argv[1], json.loads(sys.argv[5])  # text, or token ids
    repeats, threads, num_tokens = (int(arg) for arg in sys.argv[2:5])
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    no_eos = {llm.token_eos(): float("-inf")}
    rows = []
    for temperature in (0.0, 1.0):
        llm(prompt, max_tokens=4, temperature=temperature)  # warm-up
        times = []
        for i in range(repeats):
            llm.reset()  # no prompt reuse between runs: each pays its prefill
            start = time.perf_counter()
            out = llm(prompt, max_tokens=num_tokens, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                      logit_bias=no_eos, seed=i)
            times.append(time.perf_counter() - start)
            assert out["usage"]["completion_tokens"] == num_tokens, out["usage"]
        rows.append({"engine": "llama.cpp (llama-cpp-python)", "temperature": temperature,
                     "tok_s": num_tokens / statistics.median(times), "runs_s": times})
    print(json.dumps(rows))
    """
)


def pagedrs_rows(repeats: int, threads: int, activations: str = "none") -> list[dict]:
    import statistics
    import time

    import torch

    from pagedrs import LLM, SamplingParams

    torch.set_num_threads(threads)
    # each run pays its prefill
    llm = LLM(kv_cache_memory="256MiB", enable_prefix_caching=False, cpu_activation_quantization=activations)
    rows = []
    for temperature in (0.0, 1.0):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=temperature), use_tqdm=False)
        times = []
        for i in range(repeats):
            params = SamplingParams(max_tokens=NUM_TOKENS, temperature=temperature, ignore_eos=True, seed=i)
            start = time.perf_counter()
            out = llm.generate([PROMPT], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            assert len(out[0].outputs[0].token_ids) == NUM_TOKENS
        rows.append(
            {
                "engine": f"pagedrs (quantization={llm.engine.config.quantization}, activations={activations})",
                "temperature": temperature,
                "tok_s": NUM_TOKENS / statistics.median(times),
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
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        print(json.dumps(pagedrs_rows(args.repeats, args.threads, args.activations)))
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
            ],
            check=True,
            capture_output=True,
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
            str(NUM_TOKENS),
            json.dumps(PROMPT),
        ],
        check=True,
        capture_output=True,
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
