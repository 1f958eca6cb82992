"""What LoRA costs on the default model, side by side in one run:

1. ``enable_lora=True`` with no adapter in use against LoRA disabled (the same 16 streams).
2. 16 streams over 4 rank-16 adapters (4 streams each, all seven linears patched) against the
   same 16 streams on the base model, on the same engine.

Each stream: a chat prompt, 128 new tokens (``ignore_eos``), greedy and temperature 1.0.
Throughput = generated tokens / wall time of the whole batch; median over rounds, systems
alternating within each round, and the median of each round's own ratio (the machine's speed
drifts between rounds). The adapters are random (peft, ``init_lora_weights=False``)
over the default model's own architecture, written to a temporary directory.

    .venv/bin/python benches/bench_lora.py [--rounds 3] [--streams 16] [--tokens 128]

``--step``: instead, one decode step of ``--streams`` rows at context 200 through the model
runner, with and without the adapters' rows, alternating 60 times (what LoRA adds to a step,
without the scheduler, sampling and the machine's drift between whole runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

import pagedrs
from pagedrs import LLM, SamplingParams
from pagedrs.bench.hf_baseline import load_hf_model
from pagedrs.kernels.cpu import native_isa
from pagedrs.lora import LoRARequest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(directory: str, count: int, rank: int) -> list[str]:
    import peft

    paths = []
    for index in range(count):
        base, _ = load_hf_model()
        torch.manual_seed(index)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        path = f"{directory}/adapter-{index}"
        peft.get_peft_model(base, config).save_pretrained(path)
        paths.append(path)
    return paths


def run(llm: LLM, prompts, params: SamplingParams, adapters) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(output.outputs[0].token_ids) for output in outputs) / seconds


def decode_step(llm: LLM, rows: int, context: int = 200):
    """`StepArrays` of ``rows`` sequences decoding their token at ``context`` (blocks of each
    sequence contiguous)."""
    import numpy as np

    from pagedrs.engine.step_arrays import StepArrays

    block_size = llm.engine.info.config.block_size
    per_seq = -(-context // block_size)
    tables = np.arange(rows * per_seq, dtype=np.int32).reshape(1, rows, per_seq)
    position = context - 1
    slots = tables[0, :, position // block_size].astype(np.int64) * block_size + position % block_size
    lens = np.full(rows, context, np.int32)
    return StepArrays(
        np.full(rows, 42, np.int64),
        np.full(rows, position, np.int64),
        slots[None],
        np.arange(rows + 1, dtype=np.int32),
        lens,
        lens,
        tables,
        np.arange(rows, dtype=np.int64),
        np.zeros((0, 2), np.int64),
    )


def step_costs(llm: LLM, requests: list[LoRARequest], streams: int) -> dict:
    import numpy as np

    manager, runner = llm.engine.lora, llm.engine.runner
    assert manager is not None
    for request in requests:
        manager.register(request)
        assert manager.acquire(request.lora_int_id)
    base = decode_step(llm, streams)
    slots = [manager.slot(requests[i % len(requests)].lora_int_id) for i in range(streams)]
    with_adapters = base._replace(lora_rows=np.array(slots, np.int64))
    for _ in range(5):
        runner.forward(base), runner.forward(with_adapters)
    times: dict[str, list[float]] = {"base": [], "adapters": []}
    for _ in range(60):
        for name, arrays in (("base", base), ("adapters", with_adapters)):
            start = time.perf_counter()
            runner.forward(arrays)
            times[name].append(time.perf_counter() - start)
    return {
        "base_ms": round(statistics.median(times["base"]) * 1e3, 2),
        "adapters_ms": round(statistics.median(times["adapters"]) * 1e3, 2),
        "base_over_adapters_paired": round(
            statistics.median(b / a for b, a in zip(times["base"], times["adapters"])), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step", action="store_true", help="time one decode step instead (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as directory:
        paths = write_adapters(directory, args.adapters, args.rank)
        lora = LLM(kv_cache_memory="1GiB", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
        requests = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(paths)]
        if args.step:
            costs = step_costs(lora, requests, args.streams)
            print(json.dumps({"isa": native_isa(), "threads": args.threads, "streams": args.streams, **costs}))
            return
        plain = LLM(kv_cache_memory="1GiB")
        prompts = [
            plain.apply_chat_template([{"role": "user", "content": f"Tell me a story about the number {i}."}])
            for i in range(args.streams)
        ]
        spread = [requests[i % len(requests)] for i in range(args.streams)]
        record: dict = {
            "pagedrs": pagedrs.__version__,
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "isa": native_isa(),
            "threads": args.threads,
            "streams": args.streams,
            "tokens": args.tokens,
            "adapters": args.adapters,
            "rank": args.rank,
            "settings": {},
        }
        for name, temperature in (("greedy", 0.0), ("t1.0", 1.0)):
            params = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True, seed=1)
            systems = {
                "lora disabled": (plain, None),
                "enable_lora, no adapter": (lora, None),
                f"{args.adapters} adapters": (lora, spread),
            }
            for llm, adapters in systems.values():  # warm-up (and the adapters' first load)
                run(llm, prompts[:4], params, adapters[:4] if adapters else None)
            rates: dict[str, list[float]] = {system: [] for system in systems}
            for _ in range(args.rounds):
                for system, (llm, adapters) in systems.items():
                    rates[system].append(run(llm, prompts, params, adapters))
            medians = {system: statistics.median(values) for system, values in rates.items()}
            record["settings"][name] = {
                "tok_s": {system: round(value, 1) for system, value in medians.items()},
                "rounds": {system: [round(v, 1) for v in values] for system, values in rates.items()},
                "enable_lora_vs_disabled": round(medians["enable_lora, no adapter"] / medians["lora disabled"], 3),
                "adapters_vs_base": round(medians[f"{args.adapters} adapters"] / medians["enable_lora, no adapter"], 3),
                # The machine's speed drifts between rounds: each round's own ratio, then their median.
                "adapters_vs_base_paired": round(
                    statistics.median(
                        a / b for a, b in zip(rates[f"{args.adapters} adapters"], rates["enable_lora, no adapter"])
                    ),
                    3,
                ),
            }
            print(name, json.dumps(record["settings"][name]), flush=True)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
