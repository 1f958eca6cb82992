"""A Qwen3-30B-A3B-shaped mixture of experts on the CPU against a dense model with the same
active parameters, and against llama.cpp on the same GGUF file.

Both models are GGUF files of random packed Q4_0 weights (Q8_0 embeddings and head), written
here with gguf-py: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128
experts of width 768, 8 per token, q/k norms) for ``--layers`` layers (48 in the real model:
scaled down to fit memory and time), a 32,000-token vocabulary; the dense model is Qwen3 with
the same attention and one MLP of width 8 x 768 = 6,144 (the active experts' parameters).
Random router weights route tokens about uniformly, which is the worst case for batching
(real routers concentrate on fewer experts).

Measured, each in one process, side by side, median of ``--repeats``:
- decode tok/s of one stream, greedy and temperature 1.0 (steps after the prompt);
- decode tok/s of 16 streams at once (tokens per second over all of them), greedy;
- llama.cpp (``--llama-python``, llama-cpp-python's Python): 64 tokens after a 32-token prompt,
  prefill included, against pagedrs on the same file and the same work.

    PYTHONPATH=python:. .venv/bin/python benches/bench_moe.py [--layers 8] [--llama-python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_WIDTH = 128, 8, 768
VOCAB = 32000
PROMPT = [int(i) for i in np.random.default_rng(0).integers(3, VOCAB, 32)]
NEW_TOKENS = 64


def _random_blocks(rng, shape: tuple[int, ...], qtype) -> np.ndarray:
    """Random packed blocks of ``qtype`` (Q4_0 or Q8_0) for a float tensor of ``shape``: random
    quants, fp16 scales of about 1 / sqrt(in_features) / 8 (activations stay of order 1)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    *outer, cols = shape
    raw = rng.integers(0, 256, size=(*outer, cols // block, size), dtype=np.uint8)
    scale = 1.0 / np.sqrt(cols) / (8 if qtype == GGMLQuantizationType.Q4_0 else 64)
    scales = (rng.uniform(0.5, 1.5, size=(*outer, cols // block)) * scale).astype(np.float16)
    raw[..., :2] = scales.view(np.uint8).reshape(*outer, cols // block, 2)
    return raw.reshape(*outer, cols // block * size)


def write_model(path: str, layers: int, moe: bool) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    q4, q8 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(1)
    architecture = "qwen3moe" if moe else "qwen3"
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_rope_dimension_count(HEAD_DIM)
    if moe:
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(TOP_K)
        writer.add_expert_feed_forward_length(EXPERT_WIDTH)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, VOCAB)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([2, 3, 3] + [1] * (VOCAB - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def packed(name: str, shape: tuple[int, ...], qtype=q4) -> None:
        writer.add_tensor(name, _random_blocks(rng, shape, qtype), raw_dtype=qtype)

    packed("token_embd.weight", (VOCAB, HIDDEN), q8)
    packed("output.weight", (VOCAB, HIDDEN), q8)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for layer in range(layers):
        prefix = f"blk.{layer}."
        for norm, size in (
            ("attn_norm", HIDDEN),
            ("ffn_norm", HIDDEN),
            ("attn_q_norm", HEAD_DIM),
            ("attn_k_norm", HEAD_DIM),
        ):
            writer.add_tensor(prefix + norm + ".weight", np.ones(size, dtype=np.float32))
        packed(prefix + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN))
        packed(prefix + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        packed(prefix + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        packed(prefix + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM))
        if moe:
            router = (rng.standard_normal((EXPERTS, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
            writer.add_tensor(prefix + "ffn_gate_inp.weight", router)
            packed(prefix + "ffn_gate_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN))
            packed(prefix + "ffn_up_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN))
            packed(prefix + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_WIDTH))
        else:
            packed(prefix + "ffn_gate.weight", (TOP_K * EXPERT_WIDTH, HIDDEN))
            packed(prefix + "ffn_up.weight", (TOP_K * EXPERT_WIDTH, HIDDEN))
            packed(prefix + "ffn_down.weight", (HIDDEN, TOP_K * EXPERT_WIDTH))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def decode_rate(engine, streams: int, temperature: float, steps: int = 24) -> float:
    """Tokens per second of ``steps`` decode steps of ``streams`` sequences (after every prompt
    is in)."""
    from pagedrs import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=temperature, ignore_eos=True, seed=0)
    base = f"{time.monotonic_ns()}-"
    for i in range(streams):
        engine.add_request(f"{base}{i}", [*PROMPT[1:], 3 + i], params)
    generated: dict[str, int] = {}
    while len(generated) < streams or min(generated.values()) < 1:
        for output in engine.step():
            generated[output.request_id] = len(output.outputs[0].token_ids)
    before = sum(generated.values())
    start = time.perf_counter()
    for _ in range(steps):
        for output in engine.step():
            generated[output.request_id] = len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return (sum(generated.values()) - before) / elapsed


def pagedrs_rows(paths: dict[str, str], repeats: int, threads: int) -> list[dict]:
    import torch

    from pagedrs import LLM, SamplingParams

    torch.set_num_threads(threads)
    llms = {kind: LLM(path, kv_cache_memory="1GiB", enable_prefix_caching=False) for kind, path in paths.items()}
    for kind, llm in llms.items():
        assert llm.engine.runner.cpu_stack is not None, kind
        decode_rate(llm.engine, 1, 0.0, steps=2)  # warm-up
    cases = [("decode, 1 stream", 1, 0.0), ("decode, 1 stream", 1, 1.0), ("decode, 16 streams", 16, 0.0)]
    rates: dict[tuple[str, str, float], list[float]] = {}
    for _ in range(repeats):  # every case of every model in each round
        for name, streams, temperature in cases:
            for kind, llm in llms.items():
                rates.setdefault((kind, name, temperature), []).append(decode_rate(llm.engine, streams, temperature))
    rows = [
        {"engine": "pagedrs", "model": kind, "case": name, "temperature": t, "tok_s": statistics.median(v), "runs": v}
        for (kind, name, t), v in rates.items()
    ]
    # The llama.cpp comparison's work: 64 tokens after the 32-token prompt, prefill included.
    llm = llms["moe"]
    for temperature in (0.0, 1.0):
        times = []
        for i in range(repeats):
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature, ignore_eos=True, seed=i)
            start = time.perf_counter()
            llm.generate([PROMPT], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "engine": "pagedrs",
                "model": "moe",
                "case": "64 tokens after 32, prefill included",
                "temperature": temperature,
                "tok_s": NEW_TOKENS / statistics.median(times),
                "runs": times,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    parser.add_argument("--dir", help="where the GGUF files are written (default: a temporary directory)")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="pagedrs-moe-")
    paths = {kind: os.path.join(directory, f"{kind}-{args.layers}l.gguf") for kind in ("moe", "dense")}
    for kind, path in paths.items():
        if not os.path.exists(path):
            write_model(path, args.layers, moe=kind == "moe")
    rows = pagedrs_rows(paths, args.repeats, args.threads)
    if args.llama_python:
        from bench_vs_llama_cpp import LLAMA_CPP  # the same llama.cpp runner, on token ids

        command = [args.llama_python, "-c", LLAMA_CPP, paths["moe"], str(args.repeats), str(args.threads)]
        result = subprocess.run([*command, str(NEW_TOKENS), json.dumps(PROMPT)], capture_output=True, text=True)
        if result.returncode != 0:
            print(result.stderr, file=sys.stderr)
        else:
            for row in json.loads(result.stdout.strip().splitlines()[-1]):
                row.update(engine="llama.cpp", model="moe", case="64 tokens after 32, prefill included")
                rows.append(row)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
