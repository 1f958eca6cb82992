"""Single-stream decode of each model family at one size (SmolLM2-135M's shape: 30 layers,
hidden 576, 9 query and 3 KV heads, float32 random weights), side by side in one run: tokens per
second over 64 generated tokens after a 32-token prompt, greedy and at temperature 1.0, the
median of 5 rounds that each run every family once (so a drift of the machine's speed touches
each alike). Every family runs on the CPU decoder stack where it can
(`pagedrs.models.cpu_stack.why_unsupported` says why not); the output says whether it did.

    PYTHONPATH=python:. .venv/bin/python benches/bench_families.py [FAMILY ...]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch

from pagedrs import LLM, SamplingParams

NEW_TOKENS = 64
ROUNDS = 5
SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
)


def configs() -> dict[str, object]:
    import transformers

    head = {"head_dim": 64}
    return {
        "llama": transformers.LlamaConfig(**SHAPE),
        "llama3-rope": transformers.LlamaConfig(
            **SHAPE,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        ),
        "gemma2": transformers.Gemma2Config(**SHAPE, **head, sliding_window=512, query_pre_attn_scalar=64),
        "gemma3": transformers.Gemma3TextConfig(**SHAPE, **head, sliding_window=512, query_pre_attn_scalar=64),
        "phi3": transformers.Phi3Config(**SHAPE, pad_token_id=0),
        "granite": transformers.GraniteConfig(**SHAPE, embedding_multiplier=12.0, residual_multiplier=0.22),
        "olmo2": transformers.Olmo2Config(**SHAPE, pad_token_id=0, eos_token_id=1),
    }


def main() -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.checkpoints import save_word_tokenizer

    torch.set_num_threads(2)
    wanted = sys.argv[1:] or list(configs())
    prompt = list(range(100, 132))
    settings = {
        "greedy": SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        "t1.0": SamplingParams(temperature=1.0, seed=1, max_tokens=NEW_TOKENS, ignore_eos=True),
    }
    with tempfile.TemporaryDirectory() as root:
        engines = {}
        for name, config in configs().items():
            if name not in wanted:
                continue
            directory = os.path.join(root, name)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(directory)
            save_word_tokenizer(directory, SHAPE["vocab_size"])
            engines[name] = LLM(directory, kv_cache_memory="256MiB")
            engines[name].generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        # Rounds over every family, so a drift of the machine's speed touches each alike.
        rates: dict[tuple[str, str], list[float]] = {(name, s): [] for name in engines for s in settings}
        for _ in range(ROUNDS):
            for name, llm in engines.items():
                for setting, params in settings.items():
                    start = time.perf_counter()
                    llm.generate([prompt], params, use_tqdm=False)
                    rates[name, setting].append(NEW_TOKENS / (time.perf_counter() - start))
        for name, llm in engines.items():
            result: dict[str, object] = {"family": name, "cpu_stack": llm.engine.runner.cpu_stack is not None}
            for setting in settings:
                result[setting] = round(statistics.median(rates[name, setting]), 2)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
