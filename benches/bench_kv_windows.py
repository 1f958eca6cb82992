"""KV bytes one 8K-token sequence holds on a live server, for a Gemma-3-shaped model (5 sliding
layers of window 512 per global one) against the same shapes with every layer global: the
server's own block counters (``/metrics``, sampled every 10 ms by ``pagedrs memory --check``)
while the sequence decodes, and at their peak (during the prompt's last chunk, when the sliding
groups still hold the chunk's blocks). Both models are float32 random weights with Gemma 3
1B's KV shape per layer (1 KV head of 256), 12 layers; each server gets the same KV budget.

    PYTHONPATH=python:. .venv/bin/python benches/bench_kv_windows.py [--length 8192] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile

from pagedrs.memory_cli import add_memory_arguments, check, predict
from tests.helpers.checkpoints import save_word_tokenizer
from tests.helpers.servers import start_server

OUTPUT_TOKENS = 48
BUDGET = "512MiB"
SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=32768,
    sliding_window=512,
    query_pre_attn_scalar=256,
)


def save(directory: str, all_global: bool) -> None:
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(**SHAPE)
    if all_global:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    save_word_tokenizer(directory, SHAPE["vocab_size"])


def measure(directory: str, length: int, log: str) -> dict:
    parser = add_memory_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", directory, "--device", "cpu", "--dtype", "float32", "--budget", BUDGET, "--lengths", str(length)]
    )
    prediction = predict(args)
    server = start_server(
        [directory, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", BUDGET, "--max-num-seqs", "4"], log
    )
    try:
        result = check(prediction, server.base_url, OUTPUT_TOKENS)
    finally:
        server.stop()
    per_block = prediction["bytes_per_block"]
    return {
        "kv_group_windows": prediction["kv_group_windows"],
        "layers_per_block": prediction["layers_per_block"],
        "bytes_per_block": per_block,
        "decode_blocks": result["observed_decode_used_blocks"],
        "peak_blocks": result["observed_peak_used_blocks"],
        "decode_bytes": result["observed_decode_used_blocks"] * per_block,
        "peak_bytes": result["observed_peak_used_blocks"] * per_block,
        "predicted_decode_bytes": result["predicted_decode_used_blocks"] * per_block,
        "requests_ok": result["requests_ok"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=8192, help="tokens of the sequence (prompt + output)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name, all_global in (("gemma3 (5:1 sliding, W=512)", False), ("same shapes, every layer global", True)):
            directory = f"{root}/{'global' if all_global else 'sliding'}"
            save(directory, all_global)
            results[name] = measure(directory, args.length, f"{directory}.log")
    sliding, full = results.values()
    summary = {
        "length": args.length,
        "models": results,
        "decode_ratio": sliding["decode_bytes"] / full["decode_bytes"],
        "peak_ratio": sliding["peak_bytes"] / full["peak_bytes"],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    for name, r in results.items():
        print(
            f"{name}: {r['layers_per_block']} layers per block, groups {r['kv_group_windows']}; decoding "
            f"{r['decode_blocks']:.0f} blocks = {r['decode_bytes'] / 2**20:.2f} MiB (predicted at most "
            f"{r['predicted_decode_bytes'] / 2**20:.2f}), peak {r['peak_blocks']:.0f} blocks = "
            f"{r['peak_bytes'] / 2**20:.2f} MiB; {r['requests_ok']}/1 ok"
        )
    print(
        f"{args.length}-token sequence: KV bytes while decoding {summary['decode_ratio']:.3f}x the all-global "
        f"figure; at the peak {summary['peak_ratio']:.3f}x"
    )


if __name__ == "__main__":
    main()
