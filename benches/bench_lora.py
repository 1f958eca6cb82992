"""What LoRA costs on the default model, side by side in one run:

1. ``enable_lora=True`` with no adapter in use against LoRA disabled (the same 16 streams).
2. 16 streams over 4 rank-16 adapters (4 streams each, all seven linears patched) against the
   same 16 streams on the base model, on the same engine.

Each stream: a chat prompt, 128 new tokens (``ignore_eos``), greedy and temperature 1.0.
Throughput = generated tokens / wall time of the whole batch; median over rounds, systems
alternating within each round. The adapters are random (peft, ``init_lora_weights=False``)
over the default model's own architecture, written to a temporary directory.

    .venv/bin/python benches/bench_lora.py [--rounds 3] [--streams 16] [--tokens 128]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as directory:
        paths = write_adapters(directory, args.adapters, args.rank)
        plain = LLM(kv_cache_memory="1GiB")
        lora = LLM(kv_cache_memory="1GiB", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
        prompts = [
            plain.apply_chat_template([{"role": "user", "content": f"Tell me a story about the number {i}."}])
            for i in range(args.streams)
        ]
        requests = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(paths)]
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
            }
            print(name, json.dumps(record["settings"][name]), flush=True)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
