"""What torch's own weight-only quantized matmuls cost on this CPU, on the default model's linear
shapes (SmolLM2-135M: hidden 576, intermediate 1536, 49,152-token head), against float32 and
bfloat16 ``x @ w.T``: the measurement issue 17 (quantized weights) starts from.

Kernels: ``aten._weight_int8pack_mm`` (int8 weights, per-channel scales) and
``aten._weight_int4pack_mm_for_cpu`` (int4, groups of 32), each on random weights of the
right shape and dtype. Medians of 50 calls, microseconds, batch 1 (decode of one stream) and
32; torch's default thread count.

    .venv/bin/python benches/bench_quant_matmul.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

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
    return {
        "float32": lambda: x @ w.t(),
        "bfloat16": lambda: x_bf16 @ w_bf16.t(),
        "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, w_int8, scales),
        "int4pack g32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w_int4, 32, scales_and_zeros),
    }


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for batch in (1, 32):
        for name, (out_features, in_features) in SHAPES.items():
            x, w = torch.randn(batch, in_features), torch.randn(out_features, in_features)
            row = {kernel: median_us(fn) for kernel, fn in kernels(x, w).items()}
            print(json.dumps({"batch": batch, "shape": name, **row}))


if __name__ == "__main__":
    main()
