"""Single-stream decode of the default model against this machine's memory-bandwidth bound.

The bound: a decode step reads every weight once (the layers' linears and norms, and the head;
of an untied embedding table only one row), so no step can be shorter than those bytes over
the machine's read bandwidth. Measured here, in one run:

- read bandwidth (`read_bandwidth`, on the threads given): over a working set as large as the
  weights (the bound's), and over 1 GiB (memory's: before and after the decode runs, the larger;
  reported beside it). Where the last-level cache holds the weights (the 480 MiB L3 of the
  Sapphire Rapids VM of 2026-12-04), the first is the cache's and far above the second;
- weight bytes a token: every parameter and buffer of the loaded model, as stored (packed GGUF
  blocks count their bytes), less an untied embedding table;
- for each activation path (exact, int8): the decode step alone (the median of ``--steps``
  `LLMEngine.step` calls of one sequence, after 18 prompt tokens) and the rate a user sees (128
  new tokens a request, prefill included, the median of 3 requests), greedy and at temperature
  1.0. Each is also stated as a share of the bound; the step is split into the compiled stack's
  call ("stack": the decoder layers, the final norm and, where the stack takes it, the head's
  matmul), the model's own head where the stack does not take it ("head"), and the rest
  (embedding, sampler, Python);
- paired: after each timed step, one pass reading a weights-sized buffer (the first reader
  below), timed; each step's share is that pass's time over the step's (the bound at the
  bandwidth of that moment), and the share reported is their median. On a VM whose bandwidth
  moves by half within a minute (the Zen 4 and Zen 5 VMs of 2026-12), the bound measured apart
  from the steps (a best pass of many, after every path ran) can belong to another moment; the
  paired share cannot, though a single pass is no best of many. Either can be the larger (the
  VM faster during the steps or after them): both are reported.

Run on an idle machine:

    .venv/bin/python benches/bench_bandwidth_bound.py [--threads 2] [--activations none,int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
from bench_host_overhead import _Clock  # the same timing of named calls
from bench_single_stream import median_rate  # the same request rate
from torch import nn

from pagedrs import LLM, SamplingParams
from pagedrs.envinfo import environment
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.models.cpu_stack import CpuDecoderStack

PROMPT_TOKENS = list(range(1000, 1018))
NEW_TOKENS = 128
SETTINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
    "t1.0": SamplingParams(temperature=1.0, seed=1, max_tokens=NEW_TOKENS, ignore_eos=True),
}


def read_bandwidth(num_bytes: int, repeats: int = 20) -> float:
    """Bytes a second read by passes over ``num_bytes`` of float32, the fastest of ``repeats``
    passes by each of two readers (a sum; a dot product of the tensor with itself, which reads
    it faster on some machines). The same data is read pass after pass, as a decode step
    rereads the weights: a working set that fits in a large last-level cache is read from it."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    readers = [data.sum, lambda: torch.dot(data, data)]
    best = 0.0
    for read in readers:
        read()  # pages faulted in, code warm
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            best = max(best, data.numel() * data.element_size() / (time.perf_counter() - start))
    return best


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes a decode step reads of the model's tensors: all of them once, but an untied
    embedding table (one row of it is read)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", None) is not None and embed is not None:
        for t in list(embed.parameters()) + list(embed.buffers()):
            tensors.pop(id(t), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def step_ms(llm: LLM, params: SamplingParams, steps: int, probe: torch.Tensor | None = None) -> dict[str, float]:
    """The median decode step of one sequence and the medians of its parts (the stack's call,
    the model's own head, the rest), in ms; and, given a ``probe`` (weights-sized), the median
    over the steps of one pass over it, timed right after the step, over the step
    ("paired_share")."""
    engine = llm.engine
    decode = dataclasses.replace(params, max_tokens=steps + 8)
    engine.add_request("bound", PROMPT_TOKENS, decode)
    for _ in range(4):  # the prefill and a few steps before timing
        engine.step()
    clock = _Clock()
    model_class = type(engine.runner.model)
    timed = {"stack": (CpuDecoderStack, "__call__"), "head": (model_class, "compute_logits")}
    originals = {part: getattr(cls, name) for part, (cls, name) in timed.items()}
    for part, (cls, name) in timed.items():
        setattr(cls, name, clock.wrap(part, originals[part]))
    parts: dict[str, list[float]] = {"step": [], "stack": [], "head": [], "rest": []}
    if probe is not None:
        parts["paired_share"] = []
    try:
        for _ in range(steps):
            clock.seconds = {"stack": 0.0, "head": 0.0}
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            if probe is not None:
                start = time.perf_counter()
                probe.sum()
                parts["paired_share"].append((time.perf_counter() - start) / step)
            parts["step"].append(step)
            parts["stack"].append(clock.seconds["stack"])
            parts["head"].append(clock.seconds["head"])
            parts["rest"].append(step - clock.seconds["stack"] - clock.seconds["head"])
    finally:
        for part, (cls, name) in timed.items():
            setattr(cls, name, originals[part])
    while engine.has_unfinished_requests():
        engine.step()
    return {part: statistics.median(values) * (1 if part == "paired_share" else 1e3) for part, values in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activations", default="none,int8", help="cpu_activation_quantization values")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gib = 1 << 30
    before = read_bandwidth(gib, repeats=10)
    measured: dict[str, dict[str, tuple[dict[str, float], float]]] = {}  # path: setting: (step parts, tok/s)
    weight_bytes = 0
    for activations in args.activations.split(","):
        llm = LLM(kv_cache_memory="512MiB", cpu_activation_quantization=activations)
        weight_bytes = weight_bytes_per_token(llm.engine.runner.model)
        probe = torch.ones(weight_bytes // 4, dtype=torch.float32)
        llm.generate([{"prompt_token_ids": PROMPT_TOKENS}], SamplingParams(max_tokens=8), use_tqdm=False)
        measured[activations] = {
            name: (step_ms(llm, params, args.steps, probe), median_rate(llm, PROMPT_TOKENS, params))
            for name, params in SETTINGS.items()
        }
        del llm
    memory = max(before, read_bandwidth(gib, repeats=10))
    bandwidth = read_bandwidth(weight_bytes)
    bound_ms = weight_bytes / bandwidth * 1e3
    record = {
        "environment": environment(),
        "kernels": cpu_kernels.describe(),
        "threads": args.threads,
        "read_bandwidth_GBps": {"weights_sized": round(bandwidth / 1e9, 2), "1GiB": round(memory / 1e9, 2)},
        "weight_MB_per_token": round(weight_bytes / 1e6, 2),
        "bound_ms": round(bound_ms, 3),
        "paths": {
            activations: {
                name: {
                    "step_ms": round(step["step"], 3),
                    "step_parts_ms": {part: round(step[part], 3) for part in ("stack", "head", "rest")},
                    "step_share_of_bound": round(bound_ms / step["step"], 3),
                    "step_share_of_paired_bound": round(step["paired_share"], 3),
                    "request_tok_per_s": round(rate, 1),
                    "request_share_of_bound": round(rate * bound_ms / 1e3, 3),
                }
                for name, (step, rate) in settings.items()
            }
            for activations, settings in measured.items()
        },
    }
    print(record["kernels"])
    print(
        f"read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s over {weight_bytes / 1e6:.1f} MB (the "
        f"weights a token), {memory / 1e9:.1f} GB/s over 1 GiB; bound {bound_ms:.3f} ms ({1e3 / bound_ms:.0f} tok/s); "
        f"against 1 GiB's bandwidth the shares would be x{bandwidth / memory:.2f}"
    )
    print(record["environment"]["cpu"])
    print(
        f"{'path':<6} {'setting':<7} {'step ms':>8} {'stack':>7} {'head':>6} {'rest':>6} {'share':>6} {'paired':>6} "
        f"{'request tok/s':>14} {'share':>6}"
    )
    for activations, path in record["paths"].items():
        for name, row in path.items():
            parts = row["step_parts_ms"]
            print(
                f"{activations:<6} {name:<7} {row['step_ms']:>8.2f} {parts['stack']:>7.2f} {parts['head']:>6.2f} "
                f"{parts['rest']:>6.2f} {row['step_share_of_bound']:>6.0%} {row['step_share_of_paired_bound']:>6.0%} "
                f"{row['request_tok_per_s']:>14.1f} {row['request_share_of_bound']:>6.0%}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
