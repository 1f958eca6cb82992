"""One step's sampling on the CPU, at 64 and 256 rows of a 49,152-token vocabulary (float32
logits, ``randn * 3``): the compiled ops (``cpu/sampling.cpp``, through `pagedrs.sample.cpu_ops`)
against the torch path (`Sampler` of ``pagedrs/sample/sampler.py``) and a plain ``argmax``.

    .venv/bin/python benches/bench_cpu_sampling.py [--threads N] [--repeat R] [--rows 64 256]

Each number is the median over R calls, in ms, with glibc keeping freed memory as the engine
has it (`retain_freed_host_memory`). The op rows include drawing their uniforms (``torch.rand``)
and the wrappers' argument checks; the Sampler rows include its copy to the host. "logprobs=5"
for the Sampler is the difference of a greedy step with and without ``logprobs=5`` (its
``_to_host`` part)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedrs import SamplingParams
from pagedrs.engine.host_memory import retain_freed_host_memory
from pagedrs.sample import Sampler, SamplingRow
from pagedrs.sample.cpu_ops import logprob_stats, sample_from_rows

VOCAB = 49_152
MAX_DRAWS = 16  # uniforms per top-p row (the sampler's MAX_REJECTION_ROUNDS)


def median_ms(step, repeat: int) -> float:
    times = []
    for i in range(repeat + 2):
        start = time.perf_counter()
        step()
        if i >= 2:  # two warm-up calls
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def sampler_step(logits: torch.Tensor, params: SamplingParams):
    sampler = Sampler(VOCAB, seed=0)
    rows = [SamplingRow(params, None)] * len(logits)
    return lambda: sampler(logits, rows)


def bench_rows(num_rows: int, repeat: int, generator: torch.Generator) -> None:
    logits = torch.randn(num_rows, VOCAB, generator=generator) * 3
    ones, zeros = torch.ones(num_rows), torch.zeros(num_rows)
    top_p = torch.full((num_rows,), 0.95)
    token_ids = logits.argmax(dim=-1)

    argmax = median_ms(lambda: logits.argmax(dim=-1), repeat)
    greedy = median_ms(sampler_step(logits, SamplingParams(temperature=0)), repeat)
    greedy_logprobs = median_ms(sampler_step(logits, SamplingParams(temperature=0, logprobs=5)), repeat)
    rows = [
        ("argmax", argmax, None),
        ("greedy step (Sampler: argmax, copy)", greedy, None),
        (
            "temperature=1",
            median_ms(sampler_step(logits, SamplingParams(temperature=1.0)), repeat),
            median_ms(lambda: sample_from_rows(logits, ones, zeros, ones, torch.rand(num_rows, 1)), repeat),
        ),
        (
            "temperature=1, top_p=0.95",
            median_ms(sampler_step(logits, SamplingParams(temperature=1.0, top_p=0.95)), repeat),
            median_ms(lambda: sample_from_rows(logits, ones, zeros, top_p, torch.rand(num_rows, MAX_DRAWS)), repeat),
        ),
        (
            "logprobs=5 (added to a step)",
            greedy_logprobs - greedy,
            median_ms(lambda: logprob_stats(logits, token_ids, 5), repeat),
        ),
    ]
    for what, torch_ms, ops_ms in rows:
        ops = f"{ops_ms:8.2f} {ops_ms / argmax:12.2f}x" if ops_ms is not None else ""
        print(f"{num_rows:5} {what:36} {torch_ms:8.2f} {ops}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_host_memory()  # as the engine does: no page faults on every call's temporaries
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocabulary {VOCAB}, float32; median ms")
    print(f"{'rows':>5} {'what':36} {'torch':>8} {'ops':>8} {'ops / argmax':>13}")
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for num_rows in args.rows:
            bench_rows(num_rows, args.repeat, generator)


if __name__ == "__main__":
    main()
