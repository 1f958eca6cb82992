"""int8 activations (``cpu_activation_quantization="int8"``) against the exact path on this CPU:
one packed matmul at a few token counts, and a batched decode step of the default model.

- Matmuls: ``pagedrs_cpu.quant_matmul`` on random Q8_0, Q4_0 and Q4_1 weights of the default
  model's linear shapes (SmolLM2-135M: hidden 576, intermediate 1536, 49,152-token head), with
  and without ``INT8_ACTIVATIONS``, and (``panels``, where the build has them) int8 on the same
  weight in stored panels (``pack_int8_panels``, as the loader stores it), microseconds;
  ``panels_speedup`` is int8 on GGUF's rows over int8 on the panels.
- ``--step``: the default model's engine step with ``--batch`` sequences decoding (prompts of 40
  tokens), and the model's forward pass inside it, milliseconds; one engine per path, in one
  process.

Every figure is measured in ``--rounds`` rounds that alternate the two paths (so a busy
neighbour slows both alike); each round takes the median of its calls, and a row reports the
median over rounds with the lowest and highest round (``range``) and int8 / exact as a speed
ratio (exact time over int8 time: above 1 means int8 is faster). The kernel's int8 path
(``int8_activation_path``) and the thread count head the output.

    .venv/bin/python benches/bench_int8_activations.py [--tokens 1,16,64] [--formats Q8_0,Q4_1] [--shapes o,down]
    .venv/bin/python benches/bench_int8_activations.py --step [--batch 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType, quants

from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.quant.layers import INT8_ACTIVATIONS, INT8_PANELS

SHAPES = {  # name: (out_features, in_features)
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}
PATHS = ("exact", "int8")


def median_of_calls(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def summary(rounds: dict[str, list[float]], unit: float) -> dict[str, object]:
    """Median and range over rounds of each path (seconds times ``unit``) and the speed ratio."""
    digits = 1 if unit > 1e3 else 2  # microseconds to 0.1, milliseconds to 0.01
    row: dict[str, object] = {}
    for path, values in rounds.items():
        row[path] = round(statistics.median(values) * unit, digits)
        row[f"{path}_range"] = [round(min(values) * unit, digits), round(max(values) * unit, digits)]
    row["int8_speedup"] = round(statistics.median(rounds["exact"]) / statistics.median(rounds["int8"]), 2)
    if "panels" in rounds:  # stored panels against the same int8 path on GGUF's rows
        row["panels_speedup"] = round(statistics.median(rounds["int8"]) / statistics.median(rounds["panels"]), 2)
    return row


def matmuls(
    token_counts: list[int], formats: list[GGMLQuantizationType], shapes: list[str], rounds: int, calls: int
) -> None:
    ops = cpu_kernels.load()
    generator = torch.Generator().manual_seed(0)
    for qtype in formats:
        for name in shapes:
            out_features, in_features = SHAPES[name]
            weight = torch.randn(out_features, in_features, generator=generator).numpy()
            packed = torch.from_numpy(quants.quantize(weight, qtype))
            panel_rows = ops.int8_panel_rows()  # the same weight in stored panels, where this build has them
            whole = panel_rows > 0 and out_features % panel_rows == 0
            stored = ops.pack_int8_panels(packed, int(qtype), in_features) if whole else None
            for num_tokens in token_counts:
                x = torch.randn(num_tokens, in_features, generator=generator)
                kernel = {
                    "exact": functools.partial(ops.quant_matmul, x, packed, int(qtype), in_features),
                    "int8": functools.partial(ops.quant_matmul, x, packed, int(qtype) | INT8_ACTIVATIONS, in_features),
                }
                if stored is not None:
                    panels_type = int(qtype) | INT8_ACTIVATIONS | INT8_PANELS
                    kernel["panels"] = functools.partial(ops.quant_matmul, x, stored, panels_type, in_features)
                for fn in kernel.values():
                    fn()  # warm-up: buffers grown, weights in cache
                measured: dict[str, list[float]] = {path: [] for path in kernel}
                for _ in range(rounds):
                    for path, fn in kernel.items():
                        measured[path].append(median_of_calls(fn, calls))
                print(json.dumps({"format": qtype.name, "shape": name, "tokens": num_tokens, **summary(measured, 1e6)}))


def decode_step(batch: int, rounds: int, steps: int) -> None:
    """Median engine step and forward pass (ms) with ``batch`` sequences decoding, per path."""
    from pagedrs import LLM, SamplingParams

    llms = {
        path: LLM(
            kv_cache_memory="1GiB",
            enable_prefix_caching=False,
            max_num_seqs=batch,
            cpu_activation_quantization="int8" if path == "int8" else "none",
        )
        for path in PATHS
    }
    for llm in llms.values():
        llm.generate(["Hello"], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    step_rounds: dict[str, list[float]] = {path: [] for path in PATHS}
    forward_rounds: dict[str, list[float]] = {path: [] for path in PATHS}
    for index in range(rounds):
        for path, llm in llms.items():
            step_s, forward_s = _batch_steps(llm, batch, steps, f"r{index}")
            step_rounds[path].append(step_s)
            forward_rounds[path].append(forward_s)
    print(json.dumps({"batch": batch, "what": "engine step ms", **summary(step_rounds, 1e3)}))
    print(json.dumps({"batch": batch, "what": "forward ms", **summary(forward_rounds, 1e3)}))


def _batch_steps(llm, batch: int, steps: int, tag: str) -> tuple[float, float]:
    """(median engine step, median forward pass), seconds, over ``steps`` decode steps."""
    from pagedrs import SamplingParams

    engine, model = llm.engine, llm.engine.runner.model
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", torch.randint(1000, 40000, (40,), generator=generator).tolist(), params)
    while engine.scheduler.num_waiting or engine.last_schedule is None or engine.last_schedule.num_prefill_tokens:
        engine.step()
    forward_seconds: list[float] = []
    original = model.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            forward_seconds.append(time.perf_counter() - start)

    model.forward = timed
    try:
        step_seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            step_seconds.append(time.perf_counter() - start)
    finally:
        del model.forward
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(step_seconds), statistics.median(forward_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64", help="token counts of the matmuls, comma-separated")
    parser.add_argument("--formats", default="Q8_0,Q4_0,Q4_1", help="weight formats of the matmuls")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head", help="the matmuls' shapes, by layer name")
    parser.add_argument("--step", action="store_true", help="the default model's decode step instead of matmuls")
    parser.add_argument("--batch", type=int, default=64, help="sequences decoding in --step")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per round in --step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="matmul calls per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        json.dumps(
            {
                "int8_activation_path": cpu_kernels.load().int8_activation_path(),
                "threads": torch.get_num_threads(),
                "describe": cpu_kernels.describe(),
            }
        )
    )
    if args.step:
        decode_step(args.batch, args.rounds, args.steps)
        return
    try:
        formats = [GGMLQuantizationType[name.upper()] for name in args.formats.split(",") if name]
    except KeyError as error:
        raise SystemExit(f"unknown format {error}; choose among Q8_0, Q4_0, Q4_1") from None
    by_layer = {name.split()[0]: name for name in SHAPES}
    unknown = [name for name in args.shapes.split(",") if name not in by_layer]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose among {', '.join(by_layer)}")
    shapes = [by_layer[name] for name in args.shapes.split(",")]
    matmuls([int(n) for n in args.tokens.split(",") if n], formats, shapes, args.rounds, args.calls)


if __name__ == "__main__":
    main()
