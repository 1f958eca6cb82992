"""The baseline continuous batching is measured against: Hugging Face transformers
`generate` with static batches, every request asked for its own output length: greedy, or
sampled with the same temperature / top-p as the pagedrs run."""

from __future__ import annotations

import time
from typing import Any

import torch


def load_hf_model(model: str | None = None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` through transformers itself (the default model: its GGUF file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedrs.models.loader import resolve_model

    source = resolve_model(model)
    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    return hf_model, tokenizer


def run_static_batches(
    model,
    tokenizer,
    prompts: list[list[int]],
    lengths: list[int],
    batch_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    """Runs the prompts in arrival order, ``batch_size`` at a time (left-padded). A batch
    runs until its longest request is done, so shorter ones waste their slots: only each
    request's own ``length`` counts as useful. ``min_new_tokens`` keeps EOS from ending a
    batch early, matching ``ignore_eos`` on the server."""
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    useful = generated = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, wanted = prompts[first : first + batch_size], lengths[first : first + batch_size]
        width = max(len(p) for p in batch)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        longest = max(wanted)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=pad,
                **sampling,
            )
        useful += sum(wanted)
        generated += longest * len(batch)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "useful_tokens": useful,
        "generated_tokens": generated,
        "useful_tok_s": useful / elapsed,
        "useful_share": useful / generated,
        "batch_size": batch_size,
        "temperature": temperature,
        "top_p": top_p,
    }
