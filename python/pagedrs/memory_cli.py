"""``pagedrs memory``: what a KV budget holds, predicted from the model config and the real
allocator; ``--check URL`` puts the same load on a running server and compares."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from typing import Any

from pagedrs.memory import block_slack
from pagedrs.quant import QUANTIZATION_CHOICES


def add_memory_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: the default model)")
    parser.add_argument(
        "--dtype", default="auto", help="float32, bfloat16, float16, or auto (what the server picks here)"
    )
    parser.add_argument("--device", default=None, help="for --dtype auto and the default budget: cpu or cuda")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="as the server's: auto (the model's dtype), bfloat16, float16 or fp8 (e4m3)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="as the server's: the weights' predicted size depends on it (auto: a GGUF or FP8 checkpoint stays packed)",
    )
    parser.add_argument("--budget", default=None, help="KV bytes, e.g. 4GiB (default: the server's default here)")
    parser.add_argument(
        "--lengths",
        default="512,1024,2048",
        help="comma-separated sequence lengths (prompt + output tokens) of the load",
    )
    parser.add_argument(
        "--check",
        default=None,
        metavar="URL",
        help="a running pagedrs server (same model, dtype, block size and --kv-cache-memory): "
        "send the load and compare what its /metrics report",
    )
    parser.add_argument("--output-tokens", type=int, default=16, help="with --check: tokens each request generates")
    parser.add_argument("--json", action="store_true", help="print the prediction (and check) as JSON")
    return parser


def predict(args: argparse.Namespace) -> dict[str, Any]:
    from pagedrs.config import EngineConfig, resolve_dtype, resolve_kv_cache_dtype
    from pagedrs.engine.builder import plan_kv_cache
    from pagedrs.engine.kv_layout import final_blocks
    from pagedrs.models.loader import load_config, resolve_model

    engine_config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        quantization=args.quantization,
        kv_cache_memory=args.budget,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    device = engine_config.torch_device()
    dtype = resolve_dtype(engine_config.dtype, device)
    source = resolve_model(args.model)
    plan = plan_kv_cache(engine_config, source, load_config(source, engine_config.hf_overrides), device, dtype)
    weight_bytes, budget, capacity, layout = plan.weight_bytes, plan.budget_bytes, plan.capacity, plan.layout
    lengths = [int(item) for item in args.lengths.split(",") if item.strip()]
    slack = block_slack(lengths, args.block_size)
    # A block holds `layout.num_slots` layers; a sliding layer group keeps only its window's.
    blocks_per_sequence = [final_blocks(layout.group_windows, length, args.block_size) for length in lengths]
    fit, used = 0, 0
    for blocks in blocks_per_sequence:  # in the order given, as a FCFS scheduler admits them
        if used + blocks > capacity.num_blocks:
            break
        fit, used = fit + 1, used + blocks
    return {
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device)).removeprefix("torch."),
        "block_size": args.block_size,
        "quantization": args.quantization,
        "weight_bytes": weight_bytes,
        "budget_bytes": budget,
        "kv_bytes_per_token": capacity.bytes_per_token,
        "bytes_per_block": capacity.bytes_per_block,
        "kv_group_windows": list(layout.group_windows),
        "layers_per_block": layout.num_slots,
        "num_blocks": capacity.num_blocks,
        # Tokens the blocks hold in every layer (a sliding group's blocks hold fewer layers).
        "token_capacity": capacity.num_tokens * layout.num_slots // len(layout.layer_slots),
        "lengths": lengths,
        "blocks_per_sequence": blocks_per_sequence,
        "kv_bytes_per_sequence": [blocks * capacity.bytes_per_block for blocks in blocks_per_sequence],
        "full_attention_kv_bytes_per_sequence": [
            blocks * args.block_size * capacity.bytes_per_token for blocks in slack.blocks
        ],
        "max_concurrent_if_all_this_length": {
            length: capacity.num_blocks // max(1, blocks) for length, blocks in zip(lengths, blocks_per_sequence)
        },
        "load_blocks": sum(blocks_per_sequence),
        "load_fits": sum(blocks_per_sequence) <= capacity.num_blocks,
        "sequences_that_fit_in_order": fit,
        "slack_slots": slack.total_slack,
        "slack_fraction": slack.total_slack / slack.total_allocated_slots if lengths else 0.0,
    }


def check(prediction: dict[str, Any], url: str, output_tokens: int) -> dict[str, Any]:
    """Sends one request per length (exact token-id prompts, ``output_tokens`` generated,
    all at once), samples ``/metrics`` every 10 ms, and compares with the prediction. A
    sequence of total length L never stores its last sampled token: without sliding layers it
    peaks at ``ceil((L - 1) / block_size)`` blocks. A sliding layer group holds its whole
    prompt at most until the step after the prompt's last chunk, then its window's blocks
    (`pagedrs.engine.kv_layout.decode_peak_blocks`); the peak counts each sequence at the larger of
    the two."""
    from pagedrs.bench.client import Endpoint, MetricsSampler
    from pagedrs.bench.workloads import RequestSpec
    from pagedrs.engine.kv_layout import decode_peak_blocks

    endpoint = Endpoint(url)
    block = prediction["block_size"]
    info = endpoint.server_info() or {}
    specs, prompt_lens = [], []
    for index, length in enumerate(prediction["lengths"]):
        out = max(1, min(output_tokens, length - 1))
        # Ids below 300 exist in every vocabulary; distinct first tokens keep any two requests
        # from sharing a cached prefix block.
        prompt = [4 + index % 296] + [4 + (index * 7919 + i) % 296 for i in range(length - out - 1)]
        specs.append(RequestSpec(prompt=prompt, output_len=out))
        prompt_lens.append(len(prompt))

    async def load() -> tuple[list[Any], list[dict[str, float]]]:
        await endpoint.resolve_model()
        sampler = MetricsSampler(endpoint, interval=0.01)
        t0 = time.perf_counter()
        sampler.start(t0)
        results = await asyncio.gather(*(endpoint.send(spec, t0, ignore_eos=True) for spec in specs))
        await sampler.stop()
        await endpoint.client.close()
        return list(results), sampler.timeline

    before = endpoint.metrics()
    results, timeline = asyncio.run(load())
    after = endpoint.metrics()
    windows = prediction["kv_group_windows"]
    decode_peaks = [
        decode_peak_blocks(windows, prompt, length - 1, block)
        for prompt, length in zip(prompt_lens, prediction["lengths"])
    ]
    # At its prompt's last chunk, a sequence may hold the whole prompt in every group.
    predicted_peak = sum(
        max(math.ceil(prompt / block) * len(windows), peak) for prompt, peak in zip(prompt_lens, decode_peaks)
    )
    observed_peak = max((point.get("kv_used_blocks", 0.0) for point in timeline), default=0.0)
    # Decoding: from every request's second token (the step after its prompt's last chunk
    # released what its sliding groups no longer see) to the first request's end.
    ends = [r.end for r in results if r.end is not None]
    seconds = [r.chunk_times[1] for r in results if len(r.chunk_times) > 1]
    decoding = [
        point["kv_used_blocks"]
        for point in timeline
        if "kv_used_blocks" in point and len(seconds) == len(results) and max(seconds) < point["t"] < min(ends)
    ]
    return {
        "url": url,
        "server_num_blocks": after.get("kv_blocks"),
        "server_block_size": info.get("block_size"),
        "server_dtype": info.get("dtype"),
        "predicted_num_blocks": prediction["num_blocks"],
        "num_blocks_match": after.get("kv_blocks") == prediction["num_blocks"],
        "requests_ok": sum(r.success for r in results),
        "predicted_peak_used_blocks": predicted_peak if prediction["load_fits"] else prediction["num_blocks"],
        "observed_peak_used_blocks": observed_peak,
        "predicted_decode_used_blocks": sum(decode_peaks),
        "observed_decode_used_blocks": max(decoding, default=None),
        "preemptions": after.get("preemptions", 0.0) - before.get("preemptions", 0.0),
        "samples": len(timeline),
    }


def main(args: argparse.Namespace) -> int:
    prediction = predict(args)
    result = {"prediction": prediction}
    if args.check:
        result["check"] = check(prediction, args.check, args.output_tokens)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    p = prediction
    print(
        f"model {p['model']}, {p['dtype']} (KV cache {p['kv_cache_dtype']}), block size {p['block_size']}, "
        f"budget {p['budget_bytes'] / 2**20:.1f} MiB"
    )
    print(
        f"weights {p['weight_bytes'] / 2**20:.1f} MiB (quantization {p['quantization']}); "
        f"weights + KV budget {(p['weight_bytes'] + p['budget_bytes']) / 2**20:.1f} MiB"
    )
    print(f"KV bytes per token {p['kv_bytes_per_token']:,} (every layer); per block {p['bytes_per_block']:,}")
    windows = p["kv_group_windows"]
    if any(window is not None for window in windows):
        print(
            f"KV layer groups {len(windows)} of {p['layers_per_block']} layers each: "
            f"{windows.count(None)} full, the others sliding (window {sorted({w for w in windows if w})}), "
            "keeping only their window's blocks"
        )
    print(f"blocks {p['num_blocks']:,}; token capacity {p['token_capacity']:,}")
    for i, (length, blocks) in enumerate(zip(p["lengths"], p["blocks_per_sequence"])):
        kv, full = p["kv_bytes_per_sequence"][i], p["full_attention_kv_bytes_per_sequence"][i]
        print(
            f"  length {length:>7,}: {blocks:>5} blocks, {kv / 2**20:.2f} MiB of KV ({kv / full:.2f}x full "
            f"attention's); {p['max_concurrent_if_all_this_length'][length]:,} such sequences fit at once"
        )
    print(
        f"the load ({len(p['lengths'])} sequences) needs {p['load_blocks']:,} blocks: "
        f"{'fits' if p['load_fits'] else 'does not fit'}; {p['sequences_that_fit_in_order']} fit in order"
    )
    print(f"slack from block granularity: {p['slack_slots']:,} slots ({p['slack_fraction']:.2%} of allocated)")
    if "check" in result:
        c = result["check"]
        print(
            f"check against {c['url']}: server blocks {c['server_num_blocks']} vs predicted "
            f"{c['predicted_num_blocks']} ({'match' if c['num_blocks_match'] else 'MISMATCH'}); "
            f"peak used blocks observed {c['observed_peak_used_blocks']:.0f} vs predicted "
            f"{c['predicted_peak_used_blocks']}; while decoding observed {c['observed_decode_used_blocks']} vs "
            f"predicted at most {c['predicted_decode_used_blocks']}; preemptions {c['preemptions']:.0f}; "
            f"{c['requests_ok']}/{len(p['lengths'])} requests ok"
        )
    return 0
