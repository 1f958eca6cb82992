"""GGUF checkpoints read as stored: names and the q/k row order match transformers' loading,
slices dequantize exactly as ``gguf.quants`` does, and a model whose linears multiply by the
packed blocks (``quantization="auto"``) decodes greedily like transformers on the same file
(which dequantizes it), token for token except at near-ties."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import quants

from pagedrs import LLM, SamplingParams
from pagedrs.checkpoint.gguf import GGUFCheckpoint, hf_name
from pagedrs.models import build_model
from pagedrs.models.loader import load_config, resolve_model
from pagedrs.quant.layers import QuantColumnParallelLinear, QuantRowParallelLinear, QuantVocabEmbedding
from pagedrs.quant.loading import load_weights, predicted_weight_bytes
from tests.helpers.checkpoints import TINY
from tests.helpers.gguf_writer import K_CONFIG, K_TYPES, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, TYPES, write_gguf
from tests.helpers.oracle import NEW_TOKENS, PROMPTS, assert_same_or_near_tie, hf_greedy, run


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny_gguf(request, tmp_path_factory):
    """(path of a tiny Llama GGUF, transformers' model loaded from it)."""
    import transformers

    tied = request.param == "tied"
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # clear greedy choices (random weights give flat logits)
        (model.model.embed_tokens.weight if tied else model.lm_head.weight).mul_(8)
    path = str(tmp_path_factory.mktemp(f"gguf-{request.param}") / "tiny.gguf")
    write_gguf(path, model, TYPES)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    return path, hf_model


def test_tensors_and_slices_equal_what_transformers_loads(tiny_gguf):
    path, hf_model = tiny_gguf
    expected = hf_model.state_dict()
    checkpoint = GGUFCheckpoint(path)
    assert set(checkpoint.tensors) == set(expected) - (
        {"lm_head.weight"} if hf_model.config.tie_word_embeddings else set()
    )
    for name, handle in checkpoint:
        full = expected[name]
        assert handle.shape == tuple(full.shape), name
        assert torch.equal(handle[:], full), name
        if len(handle.shape) == 2:
            assert torch.equal(handle[3:11], full[3:11]), name
            assert torch.equal(handle[:, 5:40], full[:, 5:40]), name  # not on block boundaries
            assert torch.equal(handle[2:4, 32:64], full[2:4, 32:64]), name


def test_packed_rows_dequantize_as_gguf_does(tiny_gguf):
    checkpoint = GGUFCheckpoint(tiny_gguf[0])
    handle = checkpoint.tensors["model.layers.1.self_attn.k_proj.weight"]  # Q4_1, rows reordered
    assert handle.ggml_type == Q4_1
    packed = handle.packed_rows(slice(8, 24)).numpy()
    assert torch.equal(torch.from_numpy(quants.dequantize(packed, Q4_1)), handle[8:24])
    cols = handle.packed_cols(slice(32, 64)).numpy()
    assert torch.equal(torch.from_numpy(quants.dequantize(cols, Q4_1)), handle[:, 32:64])
    with pytest.raises(ValueError, match="blocks"):
        handle.packed_cols(slice(16, 48))


@pytest.mark.parametrize(
    "name",
    ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"],
    ids=["Q8_0", "F32"],
)
def test_a_column_shard_copies_only_its_columns(tiny_gguf, name):
    """A row-parallel rank's half of the columns is copied out of the memory map alone, not
    every row in full first (numpy reports its allocations to tracemalloc)."""
    import tracemalloc

    handle = GGUFCheckpoint(tiny_gguf[0]).tensors[name]
    half = slice(0, handle.shape[1] // 2)
    expected = handle[:][:, half]
    tracemalloc.start()
    try:
        values = handle[:, half]
        packed = handle.packed_cols(half) if handle.quantized else None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(values, expected)
    if packed is not None:
        assert torch.equal(packed, handle.packed_rows()[:, : packed.shape[1]])
    # Half the tensor's bytes and about a kilobyte of Python objects; a full copy of the rows
    # first would trace at least all of them.
    assert peak < handle.nbytes / 2 + 2048 < handle.nbytes, f"{peak} bytes traced for half of {handle.nbytes}"


def test_unknown_tensor_names_are_refused():
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") == "rope_freqs.weight"  # Llama 3's rotary scaling
    assert hf_name("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.gate_proj.weight"  # stacked experts
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        hf_name("blk.0.ffn_gate.3.weight")  # llama.cpp's old one-tensor-per-expert layout
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        hf_name("blk.0.ffn_gate_chexps.weight")


def test_auto_packs_single_type_linears_and_loads_the_rest_dense(tiny_gguf):
    path, hf_model = tiny_gguf
    source = resolve_model(path)
    model = build_model(load_config(source), torch.float32)
    packed = load_weights(model, source, "auto", torch.device("cpu"))
    assert packed["embed_tokens"] == Q8_0
    assert packed["layers.0.self_attn.qkv_proj"] == Q4_0
    assert "layers.1.self_attn.qkv_proj" not in packed  # q Q8_0, k/v Q4_1: one dense linear
    assert "layers.1.mlp.down_proj" not in packed  # stored as float32
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantColumnParallelLinear)
    assert isinstance(model.layers[0].mlp.down_proj, QuantRowParallelLinear)
    assert isinstance(model.embed_tokens, QuantVocabEmbedding)
    assert ("lm_head" in packed) == (not hf_model.config.tie_word_embeddings)


def test_greedy_with_packed_weights_matches_transformers_on_the_same_file(tiny_gguf):
    path, hf_model = tiny_gguf
    llm = LLM(path, quantization="auto")
    assert isinstance(llm.engine.model.embed_tokens, QuantVocabEmbedding)
    for prompt, tokens in zip(PROMPTS, run(llm, PROMPTS)):
        assert len(tokens) == NEW_TOKENS
        assert_same_or_near_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, NEW_TOKENS))


def test_k_quants_stay_packed_and_match_transformers_on_the_same_file(tmp_path):
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**K_CONFIG, tie_word_embeddings=False)).eval()
    path = str(tmp_path / "tiny-k.gguf")
    write_gguf(path, model, K_TYPES)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny-k.gguf", dtype=torch.float32
    ).eval()
    source = resolve_model(path)
    packed = load_weights(build_model(load_config(source), torch.float32), source, "auto", torch.device("cpu"))
    assert packed["embed_tokens"] == Q4_K and packed["lm_head"] == Q6_K
    assert packed["layers.0.self_attn.qkv_proj"] == Q4_K and packed["layers.1.mlp.down_proj"] == Q6_K
    assert "layers.1.self_attn.qkv_proj" not in packed  # q/k Q4_K, v Q6_K: one dense linear
    llm = LLM(path, quantization="auto")
    assert llm.engine.runner.cpu_stack is not None
    # What `pagedrs memory` predicts (the mixed q/k/v dense) is what loaded.
    loaded = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    assert predicted_weight_bytes(source, "auto", torch.float32, torch.device("cpu")) == loaded
    for prompt, tokens in zip(PROMPTS, run(llm, PROMPTS)):
        assert len(tokens) == NEW_TOKENS
        assert_same_or_near_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, NEW_TOKENS))


def test_float16_on_the_cpu_keeps_the_packed_weights_and_generates(tiny_gguf):
    """The kernel takes float16 activations, so a GGUF loaded in float16 stays packed and its
    first-token log-probs stay close to the float32 run's."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    runs = {}
    for dtype in ("float32", "float16"):
        llm = LLM(tiny_gguf[0], dtype=dtype, device="cpu", quantization="auto")
        assert isinstance(llm.engine.model.embed_tokens, QuantVocabEmbedding)
        assert isinstance(llm.engine.model.layers[0].mlp.down_proj, QuantRowParallelLinear)
        runs[dtype] = [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    for half, full in zip(runs["float16"], runs["float32"]):
        assert len(half.token_ids) == NEW_TOKENS
        first_half, first_full = half.logprobs[0], full.logprobs[0]
        shared = set(first_half) & set(first_full)
        assert shared
        assert max(abs(first_half[t].logprob - first_full[t].logprob) for t in shared) < 0.05


def test_bad_quantization_values_are_refused(tiny_gguf):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(tiny_gguf[0], quantization="fp4")
    with pytest.raises(ValueError, match="float"):
        LLM(tiny_gguf[0], quantization="int8")
