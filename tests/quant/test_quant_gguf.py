"""GGUF checkpoints read as stored: names and the q/k row order match transformers' loading,
slices dequantize exactly as ``gguf.quants`` does, and a model whose linears multiply by the
packed blocks (``quantization="auto"``) decodes greedily like transformers on the same file
(which dequantizes it), token for token except at near-ties."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from pagedrs import LLM, SamplingParams
from pagedrs.models import build_model
from pagedrs.models.loader import load_config, resolve_model
from pagedrs.quant.gguf import GGUFCheckpoint, hf_name
from pagedrs.quant.layers import QuantColumnParallelLinear, QuantRowParallelLinear, QuantVocabEmbedding
from pagedrs.quant.loading import load_weights, predicted_weight_bytes
from tests.conftest import TINY
from tests.test_model_oracle import NEW_TOKENS, PROMPTS, assert_same_or_near_tie, hf_greedy, run
from tests.test_quant_matmul import K_QUANTS, random_k_blocks

Q8_0, Q4_0, Q4_1, F32 = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, None)

# GGUF name -> stored type: every kernel format, a fused q/k/v of mixed types (loaded dense),
# and a float linear (loaded dense).
TYPES = {
    "token_embd": Q8_0,
    "output": Q4_1,
    "blk.0.attn_q": Q4_0,
    "blk.0.attn_k": Q4_0,
    "blk.0.attn_v": Q4_0,
    "blk.0.attn_output": Q8_0,
    "blk.0.ffn_gate": Q4_1,
    "blk.0.ffn_up": Q4_1,
    "blk.0.ffn_down": Q4_0,
    "blk.1.attn_q": Q8_0,
    "blk.1.attn_k": Q4_1,
    "blk.1.attn_v": Q4_1,
    "blk.1.attn_output": Q4_1,
    "blk.1.ffn_gate": Q8_0,
    "blk.1.ffn_up": Q8_0,
    "blk.1.ffn_down": F32,
}

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
# Like llama.cpp's Q4_K_M: Q4_K, with Q6_K for the head, the down projections and (in one
# layer) the v projection, which makes that layer's fused q/k/v mixed (loaded dense); on a
# model whose linears are whole 256-weight blocks.
K_CONFIG = dict(TINY, hidden_size=256, intermediate_size=512)
K_TYPES = {"token_embd": Q4_K, "output": Q6_K} | {
    f"blk.{layer}.{part}": Q6_K if part == "ffn_down" or (layer == 1 and part == "attn_v") else Q4_K
    for layer in (0, 1)
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
}

_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, layer, *rest = name.split(".")
        return f"blk.{layer}.{_HF_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
        name, "output.weight"
    )


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for q and k (the inverse of what loaders undo)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(path: str, model, types: dict) -> None:
    """``model`` (a transformers Llama) as a GGUF file with a tiny SentencePiece vocabulary.
    Tensors given a k-quant type hold random blocks instead (gguf.quants cannot quantize to
    them): the oracle must then load the file itself."""
    config = model.config
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, config.vocab_size)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if "rotary" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        array = tensor.float().numpy()
        target = gguf_name(name)
        if ".attn_q." in target:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif ".attn_k." in target:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = types.get(target.removesuffix(".weight")) if array.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(target, array)
        elif qtype in K_QUANTS:
            blocks = random_k_blocks(qtype, *array.shape, seed=len(target), scale_range=(1e-4, 4e-4), centred=True)
            writer.add_tensor(target, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(target, quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        hf_name("blk.0.ffn_gate_exps.weight")


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
    assert llm.engine.runner.model.cpu_stack is not None
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
