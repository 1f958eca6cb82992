"""Weight-only quantized matmuls on this CPU, on the default model's linear shapes (SmolLM2-135M:
hidden 576, intermediate 1536, 49,152-token head), against float32 and bfloat16 ``x @ w.T``.

Kernels: pagedrs' own ``pagedrs_cpu.quant_matmul`` on GGUF blocks (Q8_0, Q4_1; Q4_K and Q6_K on
random superblocks where the input features are whole 256-weight blocks), and torch's
``aten._weight_int8pack_mm`` (int8 weights, per-channel scales) and
``aten._weight_int4pack_mm_for_cpu`` (int4, groups of 32), each on random weights of the right
shape and dtype. Medians of 50 calls, microseconds, batch 1 (decode of one stream) and 32;
torch's default thread count.

    .venv/bin/python benches/bench_quant_matmul.py            # the matmuls
    .venv/bin/python benches/bench_quant_matmul.py --model    # the default model, auto vs none

``--model`` loads the default model once per ``quantization`` (``auto``: its own Q4_1/Q8_0
blocks; ``none``: dequantized to float32), each in a fresh process, and reports the resident
memory the load added (``load_rss_MB``: weights, KV cache of 64 MiB, tokenizer, and what the
allocator keeps of load-time temporaries) and the process's resident total (``rss_MB``), and
single-stream greedy decode (128 new tokens after a short prompt,
median of 3 runs, tokens per second over the whole request, prefill included).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType, quants

SHAPES = {  # name: (out_features, in_features)
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}


def median_us(fn: Callable[[], object], repeats: int = 50) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def kernels(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    out_features, in_features = w.shape
    w_bf16, x_bf16 = w.bfloat16(), x.bfloat16()
    scales = w.abs().amax(dim=1) / 127
    w_int8 = (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
    w_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (out_features, in_features), dtype=torch.int32), 1
    )
    scales_and_zeros = torch.randn(in_features // 32, out_features, 2)
    from pagedrs.kernels import cpu as cpu_kernels

    ops = cpu_kernels.load()
    packed = {
        qtype: torch.from_numpy(quants.quantize(w.numpy(), qtype))
        for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1)
    }
    q8, q4 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1
    k_quants: dict[str, Callable[[], object]] = {}
    if in_features % 256 == 0:  # k-quants take whole 256-weight superblocks (random ones here)
        from tests.helpers.k_quants import random_k_blocks

        for qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
            blocks = torch.from_numpy(random_k_blocks(qtype, out_features, in_features, seed=0))
            k_quants[f"pagedrs {qtype.name}"] = functools.partial(ops.quant_matmul, x, blocks, int(qtype), in_features)
    return {
        "pagedrs Q8_0": lambda: ops.quant_matmul(x, packed[q8], int(q8), in_features),
        "pagedrs Q4_1": lambda: ops.quant_matmul(x, packed[q4], int(q4), in_features),
        **k_quants,
        "float32": lambda: x @ w.t(),
        "bfloat16": lambda: x_bf16 @ w_bf16.t(),
        "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, w_int8, scales),
        "int4pack g32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w_int4, 32, scales_and_zeros),
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_run(quantization: str) -> dict:
    """One process's load and decode of the default model."""
    from pagedrs import LLM, SamplingParams

    before = rss_bytes()
    start = time.perf_counter()
    llm = LLM(device="cpu", quantization=quantization, kv_cache_memory="64MiB")
    load_s = time.perf_counter() - start
    loaded = rss_bytes()
    weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompt = "Write a short story about a robot who learns to paint."
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        rates.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - start))
    return {
        "quantization": quantization,
        "load_s": round(load_s, 2),
        "weight_MB": round(weights / 1e6, 1),
        "load_rss_MB": round((loaded - before) / 2**20, 1),
        "rss_MB": round(loaded / 2**20, 1),
        "tok_per_s": round(statistics.median(rates), 1),
    }


def model_main() -> None:
    results = {}
    for quantization in ("auto", "none"):
        line = (
            subprocess.run(
                [sys.executable, __file__, "--model-run", quantization], check=True, capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        results[quantization] = json.loads(line)
        print(line)
    auto, none = results["auto"], results["none"]
    print(
        json.dumps(
            {
                "decode_speedup": round(auto["tok_per_s"] / none["tok_per_s"], 2),
                "load_rss_ratio": round(auto["load_rss_MB"] / none["load_rss_MB"], 3),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="store_true", help="the default model, auto vs none")
    parser.add_argument("--model-run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model_run:
        print(json.dumps(model_run(args.model_run)))
        return
    if args.model:
        model_main()
        return
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for batch in (1, 32):
        for name, (out_features, in_features) in SHAPES.items():
            x, w = torch.randn(batch, in_features), torch.randn(out_features, in_features)
            row = {kernel: median_us(fn) for kernel, fn in kernels(x, w).items()}
            print(json.dumps({"batch": batch, "shape": name, **row}))


if __name__ == "__main__":
    main()
