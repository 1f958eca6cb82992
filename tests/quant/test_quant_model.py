"""The default model (a Q4_1 GGUF) decodes greedily the same with its own packed weights
(``quantization="auto"``) as dequantized (``"none"``), except at near-ties, from ~5x fewer weight
bytes; ``quantization="int8"`` packs a float checkpoint's linears at load time and stays close to
the float model."""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.models.loader import resolve_model
from pagedrs.quant.layers import QuantColumnParallelLinear, QuantRowParallelLinear, QuantVocabEmbedding
from pagedrs.quant.loading import predicted_weight_bytes

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build here"),
    pytest.mark.slow,  # the default model, or packing int8 at load time: over 10 s each
]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
]


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())


def predicted(model: str | None, quantization: str) -> int:
    return predicted_weight_bytes(resolve_model(model), quantization, torch.float32, torch.device("cpu"))


def greedy(llm: LLM, num_tokens: int, logprobs: int | None = None):
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=logprobs)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_default_model_packed_decodes_as_dequantized():
    packed = LLM(device="cpu", quantization="auto", kv_cache_memory="64MiB")
    assert isinstance(packed.engine.model.embed_tokens, QuantVocabEmbedding)  # the tied head too
    # Every linear holds uint8 blocks: only the norms are float.
    float_params = [name for name, p in packed.engine.model.named_parameters() if p.dtype != torch.uint8]
    assert all("norm" in name for name in float_params), float_params
    ours = greedy(packed, 24)
    packed_bytes = weight_bytes(packed)
    assert packed_bytes == predicted(None, "auto")  # what `pagedrs memory` reports
    del packed
    dense = LLM(device="cpu", quantization="none", kv_cache_memory="64MiB")
    assert packed_bytes * 5 < weight_bytes(dense) == predicted(None, "none")
    theirs = greedy(dense, 24, logprobs=2)
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        if a.token_ids == b.token_ids:
            continue
        at = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top2 = sorted((lp.logprob for lp in b.logprobs[at].values()), reverse=True)[:2]
        assert top2[0] - top2[1] < 1e-3, f"{prompt!r} diverged at token {at} with a logit gap {top2[0] - top2[1]}"


def test_int8_packs_a_float_checkpoint_and_stays_close(tiny_llama):
    dense = LLM(tiny_llama, quantization="none")
    int8 = LLM(tiny_llama, quantization="int8")
    layer = int8.engine.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantColumnParallelLinear)
    assert isinstance(layer.mlp.down_proj, QuantRowParallelLinear)
    assert weight_bytes(int8) * 3 < weight_bytes(dense)
    assert weight_bytes(int8) == predicted(tiny_llama, "int8")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompt = [[5, 17, 33, 2, 9, 40, 41]]
    theirs = dense.generate(prompt, params, use_tqdm=False)[0].outputs[0].logprobs[0]
    ours = int8.generate(prompt, params, use_tqdm=False)[0].outputs[0].logprobs[0]
    shared = set(ours) & set(theirs)
    assert len(shared) >= 3
    for token in shared:
        assert abs(ours[token].logprob - theirs[token].logprob) < 0.02


def test_int8_on_a_gguf_or_a_bad_value_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(tiny_llama, quantization="Q4")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(device="cpu", quantization="int8")
