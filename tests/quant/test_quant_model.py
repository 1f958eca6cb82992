"""The default model (a Q4_1 GGUF) decodes greedily the same with its own packed weights
(``quantization="auto"``) as dequantized (``"none"``), except at near-ties, from ~5x fewer weight
bytes; ``quantization="int8"`` packs a float checkpoint's linears at load time and stays close to
the float model."""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.engine import model_runner
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
    # On AVX2 builds the exact path reads Q8_0/Q4_0/Q4_1 rows with their scales first.
    packed_types = (QuantColumnParallelLinear, QuantRowParallelLinear, QuantVocabEmbedding)
    stored = [m for m in packed.engine.model.modules() if isinstance(m, packed_types)]
    assert len(stored) == 30 * 4 + 1 and all(m.scales_first == cpu_kernels.load().scales_first_rows() for m in stored)
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


@pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.load().scales_first_rows(),
    reason="this build reads no scales-first rows (AVX2 builds only)",
)
def test_scales_first_rows_decode_as_gguf_rows(monkeypatch):
    """The default model with its rows in the scales-first order (AVX2's default) against the
    same model on GGUF's rows: the same weights, sums in another order, so the same greedy
    tokens and logprobs equal to float32 rounding."""
    ours = greedy(LLM(kv_cache_memory="64MiB"), 16, logprobs=3)
    monkeypatch.setattr(model_runner, "use_scales_first", lambda model: 0)
    gguf_rows = LLM(kv_cache_memory="64MiB")
    assert not gguf_rows.engine.model.embed_tokens.scales_first
    theirs = greedy(gguf_rows, 16, logprobs=3)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        for mine, other in zip(a.logprobs, b.logprobs):
            assert mine.keys() == other.keys()
            assert all(abs(mine[t].logprob - other[t].logprob) < 1e-4 for t in mine)


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


# A fixed text for the int8-activation path's accuracy (the default model, teacher-forced).
FIXED_TEXT = (
    "A paged KV cache stores each sequence's keys and values in fixed-size blocks, so memory is "
    "allocated as the sequence grows and freed when it finishes. Requests that share a prompt "
    "prefix can share its blocks, and a scheduler that runs every request one step at a time can "
    "admit new ones as soon as there is room. The cost of a step is mostly reading the weights: "
    "a small model on a laptop decodes at the speed its memory delivers them, which is why the "
    "weights are kept in four or eight bits and multiplied without first being expanded to floats. "
    "The same reasoning says that a batch of sixteen requests costs little more than one."
)


def _text_logprobs(llm: LLM, token_ids: list[int]) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0)
    entries = llm.generate([token_ids], params, use_tqdm=False)[0].prompt_logprobs
    return [{t: lp.logprob for t, lp in entry.items()} if entry else {} for entry in entries]


def test_int8_activations_stay_close_to_the_exact_path_on_the_default_model():
    """``cpu_activation_quantization="int8"`` on the default model (Q4_1 linears, a Q8_0 head),
    teacher-forced over a fixed text: the text's perplexity within 1% of the exact path's and
    the most likely next token the same at >= 90% of positions (measured here: docs/cpu.md)."""
    exact = LLM(enable_prefix_caching=False)
    int8 = LLM(enable_prefix_caching=False, cpu_activation_quantization="int8")
    assert int8.engine.runner.cpu_stack is not None  # the stack multiplies by int8 activations too
    linear = int8.engine.model.layers[0].mlp.down_proj
    assert isinstance(linear, QuantRowParallelLinear) and linear.int8_activations
    # An x86 build reads the linears and the tied head (also the embedding) from stored panels.
    panels = cpu_kernels.load().int8_panel_rows() > 0
    assert linear.int8_panels == panels and int8.engine.model.embed_tokens.int8_panels == panels
    token_ids = exact.get_tokenizer().encode(FIXED_TEXT)
    ours, theirs = _text_logprobs(exact, token_ids), _text_logprobs(int8, token_ids)
    agree, nll_exact, nll_int8 = 0, 0.0, 0.0
    for position in range(1, len(token_ids)):
        token = token_ids[position]
        nll_exact -= ours[position][token]
        nll_int8 -= theirs[position][token]
        agree += max(ours[position], key=ours[position].get) == max(theirs[position], key=theirs[position].get)
    positions = len(token_ids) - 1
    print(f"log-perplexity {nll_exact / positions:.4f} -> {nll_int8 / positions:.4f}, top-1 {agree / positions:.3f}")
    assert abs(nll_int8 - nll_exact) / positions < 0.01  # log-perplexity within 0.01 nats
    assert agree / positions >= 0.9


def test_int8_activations_need_packed_linears(tiny_llama):
    with pytest.raises(ValueError, match="needs packed Q8_0, Q4_0 or Q4_1 linears"):
        LLM(tiny_llama, quantization="none", cpu_activation_quantization="int8")
    with pytest.raises(ValueError, match="cpu_activation_quantization"):
        LLM(tiny_llama, cpu_activation_quantization="int4")
    llm = LLM(tiny_llama, quantization="int8", cpu_activation_quantization="int8")  # packed at load: runs
    assert len(llm.generate([[5, 17, 33]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_classifier_from_token_reads_a_packed_heads_values():
    """A GGUF head's rows are packed blocks: the classifier takes the values the head multiplies
    by (it once took the bytes), so its scores are the head's logits of those tokens."""
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    llm = LLM(kv_cache_memory="64MiB", hf_overrides=overrides)
    model = llm.engine.model
    assert isinstance(model.embed_tokens, QuantVocabEmbedding)
    ids = [llm.get_tokenizer().convert_tokens_to_ids(token) for token in ("no", "yes")]
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = model.embed_tokens.logits(hidden)[:, ids]
    torch.testing.assert_close(model.classify(hidden), expected, rtol=1e-5, atol=1e-4)
