"""``kv_cache_dtype``: a bfloat16 or float16 KV cache under a float32 model on the CPU holds twice
the tokens in the same budget, an fp8 (e4m3) one four times, runs through the compiled stack and
the Python layers alike, and moves logprobs by no more than the rounding of the cached keys and
values does."""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.config import resolve_kv_cache_dtype
from pagedrs.kernels.cpu import available as cpu_kernels_available
from pagedrs.memory import kv_bytes_per_token

PROMPTS = [list(range(10, 60)), [7, 7, 7, 300, 12, 64, 19, 81, 44, 3, 99, 250, 31]]
NEW_TOKENS = 16
BOUNDS = {"bfloat16": 0.005, "float16": 0.005, "fp8": 0.02}
"""The largest logprob change of a chosen token against the float32 cache (measured on the tiny
random Llama: 0.0003 for bfloat16, 0.00005 for float16, 0.004 for fp8)."""
BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1}
STEP = {"bfloat16": 2**-7, "float16": 2**-10, "fp8": 2**-3}
"""One rounding step of each cache dtype, relative to the value (its mantissa's last bit)."""
CPU = torch.device("cpu")


def _logprobs(llm: LLM) -> list[list[tuple[int, float]]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        [(token, completion.logprobs[i][token].logprob) for i, token in enumerate(completion.token_ids)]
        for completion in (output.outputs[0] for output in outputs)
    ]


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16", "fp8"])
def test_a_smaller_cache_holds_more_tokens_and_stays_close(tiny_llama, cache_dtype):
    # Small blocks and chunks of 8 tokens: prefills in chunks over cached blocks.
    shape = {"kv_cache_memory": 64 * 2**10, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4}
    exact = LLM(tiny_llama, **shape)
    half = LLM(tiny_llama, **shape, kv_cache_dtype=cache_dtype)
    layers = LLM(tiny_llama, **shape, kv_cache_dtype=cache_dtype, attention_backend="torch")
    assert half.engine.runner.kv_caches[0][0].dtype == resolve_kv_cache_dtype(cache_dtype, torch.float32, CPU)
    shrink = 4 // BYTES[cache_dtype]
    assert half.engine.info.num_blocks == shrink * exact.engine.info.num_blocks
    assert kv_bytes_per_token(tiny_llama, cache_dtype) * shrink == kv_bytes_per_token(tiny_llama, "float32")
    assert (half.engine.runner.cpu_stack is not None) == cpu_kernels_available()
    ours, stack, python = _logprobs(exact), _logprobs(half), _logprobs(layers)
    # Both paths stored the same rounded rows: the caches agree, one rounding step at most
    # (a key a float32 ulp apart in the two paths may round the other way).
    for (stack_keys, stack_values), (python_keys, python_values) in zip(
        half.engine.runner.kv_caches, layers.engine.runner.kv_caches
    ):
        for a, b in ((stack_keys.float(), python_keys.float()), (stack_values.float(), python_values.float())):
            written = (a != 0) | (b != 0)
            identical = (a[written] == b[written]).float().mean().item()
            print(f"{cache_dtype}: {identical:.4f} of {int(written.sum())} cached values identical")
            assert identical > 0.95
            # (atol: fp8's subnormal step.)
            torch.testing.assert_close(a, b, rtol=STEP[cache_dtype], atol=2**-9 if cache_dtype == "fp8" else 1e-6)
    worst = 0.0
    for exact_row, half_row, python_row in zip(ours, stack, python):
        # The stack and the Python layers round the cached rows alike.
        assert [token for token, _ in half_row] == [token for token, _ in python_row]
        assert [lp for _, lp in half_row] == pytest.approx([lp for _, lp in python_row], abs=1e-4)
        for (token, logprob), (half_token, half_logprob) in zip(exact_row, half_row):
            if token != half_token:
                break  # a near tie went the other way: the rest follows another path
            assert abs(logprob - half_logprob) < BOUNDS[cache_dtype]
            worst = max(worst, abs(logprob - half_logprob))
    print(f"{cache_dtype}: largest logprob change {worst:.5f}")
    assert half.engine.scheduler.stats().num_used_blocks == 0


def test_cache_dtypes_the_kernels_cannot_read_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="a cache of another dtype runs on the CPU under a float32 model only"):
        LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="a cache of another dtype runs on the CPU under a float32 model only"):
        LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_llama, kv_cache_dtype="fp8_e5m2")
    # The GPU kernels read the model's own dtype (checked without a GPU: the rule alone).
    with pytest.raises(ValueError, match="on cuda"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, torch.device("cuda"))
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, CPU) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="on cuda"):
        resolve_kv_cache_dtype("fp8", torch.float32, torch.device("cuda"))


def test_the_start_log_names_the_kernel_paths_and_the_approximations(tiny_llama, caplog):
    caplog.set_level("INFO", logger="pagedrs")
    LLM(tiny_llama, kv_cache_dtype="float16")
    messages = [record.getMessage() for record in caplog.records]
    if cpu_kernels_available():
        assert any(message.startswith("CPU kernels for ") and "packed matmul" in message for message in messages)
    assert "approximate arithmetic asked for: KV cache float16, activations none" in messages


@pytest.mark.parametrize("cache_dtype", ["float16", "fp8"])
def test_a_cached_prefix_in_a_smaller_cache_gives_what_recomputing_it_gives(tiny_llama, cache_dtype):
    """Prefix reuse stays exact under a rounded cache: a prompt's own chunks read their keys and
    values back from the cache, rounded, so blocks another request left there hold the very
    values a recomputation would."""
    shape = {"kv_cache_memory": 64 * 2**10, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4}
    cached = LLM(tiny_llama, **shape, kv_cache_dtype=cache_dtype)
    fresh = LLM(tiny_llama, **shape, kv_cache_dtype=cache_dtype, enable_prefix_caching=False)
    prompt = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    first = cached.generate([prompt], params, use_tqdm=False)[0]
    again = cached.generate([prompt + [77]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 28
    expected = fresh.generate([prompt + [77]], params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids  # the first request ran
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    ours = [entry[token].logprob for entry, token in zip(again.outputs[0].logprobs, again.outputs[0].token_ids)]
    theirs = [entry[token].logprob for entry, token in zip(expected.outputs[0].logprobs, expected.outputs[0].token_ids)]
    assert ours == pytest.approx(theirs, abs=1e-5)
