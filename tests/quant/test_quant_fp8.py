"""FP8 (e4m3) weights: compressed-tensors checkpoints (per-channel and per-tensor scales, as
llm-compressor's FP8-dynamic models are written) load with their e4m3 linears kept and decode
greedily like transformers on the dequantized weights (except at near-ties);
``quantization="fp8"`` quantizes a float checkpoint at load time and stays close to it;
tensor-parallel shards of an FP8 layer put back together are the full weight; the
``torch._scaled_mm`` path (FP8 activations) agrees with the dequantizing fallback."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pagedrs import LLM, SamplingParams
from pagedrs.checkpoint import ModelSource
from pagedrs.layers.linear import ColumnParallelLinear, RowParallelLinear, TensorParallel
from pagedrs.models import build_model
from pagedrs.models.loader import load_config, resolve_model
from pagedrs.quant import fp8
from pagedrs.quant.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear, Fp8WeightHandle
from pagedrs.quant.loading import load_weights, predicted_weight_bytes
from tests.helpers.checkpoints import TINY, save_word_tokenizer
from tests.helpers.fp8_writer import compressed_tensors_config, write_fp8_checkpoint
from tests.helpers.oracle import NEW_TOKENS, PROMPTS, assert_same_or_near_tie, hf_greedy, run


def tiny_hf_llama(seed: int):
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # clear greedy choices
    return model


@pytest.fixture(scope="module", params=["channel", "tensor"])
def fp8_checkpoint(request, tmp_path_factory):
    """(directory, strategy, the float oracle: transformers on the dequantized weights)."""
    hf_model = tiny_hf_llama(11)
    directory = str(tmp_path_factory.mktemp(f"fp8-{request.param}"))
    write_fp8_checkpoint(directory, hf_model, request.param)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return directory, request.param, hf_model


def loaded_weight_bytes(llm: LLM) -> int:
    model = llm.engine.model
    scales = [b for name, b in model.named_buffers() if name.endswith("weight_scale")]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *scales])


def predicted(directory: str, quantization: str) -> int:
    return predicted_weight_bytes(resolve_model(directory), quantization, torch.float32, torch.device("cpu"))


def first_token_logprobs(llm: LLM, prompts: list[list[int]]) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [{token: lp.logprob for token, lp in out.outputs[0].logprobs[0].items()} for out in outputs]


def max_logprob_error(ours: list[dict[int, float]], theirs: list[torch.Tensor]) -> float:
    return max(abs(lp - float(ref[token])) for got, ref in zip(ours, theirs) for token, lp in got.items())


def test_fp8_checkpoint_keeps_e4m3_linears_and_decodes_like_transformers_on_the_dequantized_weights(fp8_checkpoint):
    directory, strategy, hf_model = fp8_checkpoint
    llm = LLM(directory, quantization="auto")
    layer = llm.engine.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8ColumnParallelLinear)
    assert isinstance(layer.mlp.down_proj, Fp8RowParallelLinear)
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert llm.engine.model.lm_head.weight.dtype == torch.float32  # ignored, as the config says
    assert loaded_weight_bytes(llm) == predicted(directory, "auto")  # what `pagedrs memory` reports
    for prompt, tokens in zip(PROMPTS, run(llm, PROMPTS)):
        assert len(tokens) == NEW_TOKENS
        assert_same_or_near_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, NEW_TOKENS))
    with torch.no_grad():
        theirs = [hf_model(torch.tensor([p])).logits[0, -1].log_softmax(-1) for p in PROMPTS]
    error = max_logprob_error(first_token_logprobs(llm, PROMPTS), theirs)
    print(f"FP8 {strategy}: max log-prob error against transformers on the dequantized weights {error:.2e}")
    assert error < 1e-4  # float32 both ways: accumulation order only


def test_none_dequantizes_an_fp8_checkpoint_exactly(fp8_checkpoint):
    directory, _, hf_model = fp8_checkpoint
    source = resolve_model(directory)
    model = build_model(load_config(source), torch.float32)
    assert load_weights(model, source, "none", torch.device("cpu")) == {}
    assert isinstance(model.layers[1].mlp.down_proj, RowParallelLinear)
    expected = hf_model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(model.layers[1].mlp.down_proj.weight, expected)
    q, k, v = (getattr(hf_model.model.layers[0].self_attn, name).weight for name in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert predicted(directory, "none") == sum(p.numel() * 4 for p in model.parameters())


def test_scaled_mm_path_of_a_loaded_model_stays_close_to_the_fallback(fp8_checkpoint):
    """FP8 activations (per token) through ``torch._scaled_mm``, as on a Hopper GPU, where the
    installed torch runs it on the CPU."""
    if not scaled_mm_runs_on_cpu():
        pytest.skip("torch._scaled_mm does not run on the CPU in this torch")
    directory, strategy, hf_model = fp8_checkpoint
    llm = LLM(directory, quantization="auto")
    fp8_layers = [m for m in llm.engine.model.modules() if isinstance(m, fp8._Fp8Linear)]
    assert len(fp8_layers) == 8
    for module in fp8_layers:
        module.scaled_mm = True
    with torch.no_grad():
        theirs = [hf_model(torch.tensor([p])).logits[0, -1].log_softmax(-1) for p in PROMPTS]
    error = max_logprob_error(first_token_logprobs(llm, PROMPTS), theirs)
    print(f"FP8 {strategy} through _scaled_mm (W8A8): max log-prob error {error:.3f}")
    assert error < 0.1


def test_fp8_quantizes_a_float_checkpoint_and_stays_close(tiny_llama):
    dense = LLM(tiny_llama, quantization="none")
    quantized = LLM(tiny_llama, quantization="fp8")
    layer = quantized.engine.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, Fp8ColumnParallelLinear)
    assert isinstance(layer.self_attn.o_proj, Fp8RowParallelLinear)
    # A byte a weight (and a scale a row) for the linears; the embedding and head stay float32.
    assert loaded_weight_bytes(quantized) < 0.6 * loaded_weight_bytes(dense)
    assert loaded_weight_bytes(quantized) == predicted(tiny_llama, "fp8")
    prompts = [[5, 17, 33, 2, 9, 40, 41], list(range(10, 47))]
    theirs = first_token_logprobs(dense, prompts)
    ours = first_token_logprobs(quantized, prompts)
    errors = [abs(ours[i][t] - theirs[i][t]) for i in range(len(prompts)) for t in set(ours[i]) & set(theirs[i])]
    assert len(errors) >= 6
    print(f"fp8 of a float checkpoint: max log-prob error {max(errors):.4f}")
    assert max(errors) < 0.02


def test_block_wise_checkpoint_loads_dense_under_auto_as_predicted(tmp_path):
    """Block-wise scales (``weight_block_size``) do not fit the per-channel FP8 layers:
    ``auto`` loads the dequantized weights dense (as `pagedrs memory` predicts) and ``fp8``
    requantizes them per channel, instead of either failing halfway through loading."""
    hf_model = tiny_hf_llama(13)
    directory = str(tmp_path)
    write_fp8_checkpoint(directory, hf_model, "block")
    save_word_tokenizer(directory, TINY["vocab_size"])
    auto = LLM(directory, quantization="auto")
    model = auto.engine.model
    assert not any(isinstance(m, fp8._Fp8Linear) for m in model.modules())
    assert torch.equal(model.layers[1].mlp.down_proj.weight, hf_model.model.layers[1].mlp.down_proj.weight)
    assert loaded_weight_bytes(auto) == predicted(directory, "auto") == predicted(directory, "none")
    for prompt, tokens in zip(PROMPTS, run(auto, PROMPTS)):
        assert_same_or_near_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, NEW_TOKENS))
    requantized = LLM(directory, quantization="fp8")
    layer = requantized.engine.model.layers[1].mlp.down_proj
    assert isinstance(layer, Fp8RowParallelLinear)
    expected = hf_model.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(fp8.dequantize(layer.weight, layer.weight_scale), expected, rtol=0.07, atol=1e-6)
    assert loaded_weight_bytes(requantized) == predicted(directory, "fp8")


# --------------------------------------------------------------------------- layers and shards


def scaled_mm_runs_on_cpu() -> bool:
    one = torch.ones((), dtype=torch.float32)
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.fixture
def fp8_file(tmp_path):
    """A checkpoint file holding one e4m3 weight ``w`` [96, 64] with per-channel scales, the
    same weight with block scales (``b``, 32 x 32 blocks), and the float weight it came from."""
    torch.manual_seed(3)
    full = torch.randn(96, 64)
    values, scale = fp8.quantize_per_channel(full)
    block_scale = torch.rand(3, 2) + 0.5
    path = str(tmp_path / "w.safetensors")
    save_file({"w": values, "w_scale": scale[:, None], "b": values.clone(), "b_scale_inv": block_scale}, path)
    with safe_open(path, framework="pt") as file:
        yield file, fp8.dequantize(values, scale), block_scale


def test_shards_of_two_ranks_put_back_together_are_the_full_weight(fp8_file):
    file, full, _ = fp8_file
    handle = Fp8WeightHandle(file, "w", file.get_tensor("w_scale"), None)
    assert torch.equal(handle[:], full) and torch.equal(handle[10:20], full[10:20])
    # Column parallel over a fused [q 64, k 16, v 16] layer: each rank holds half of each.
    ranks = []
    for rank in range(2):
        dense = ColumnParallelLinear(64, [64, 16, 16], False, TensorParallel(rank, 2), torch.float32)
        layer = Fp8ColumnParallelLinear(dense)
        for shard, rows in enumerate([slice(0, 64), slice(64, 80), slice(80, 96)]):
            layer.load(shard, _RowView(handle, rows))
        ranks.append(fp8.dequantize(layer.weight, layer.weight_scale))
    for rows, half in [(slice(0, 64), 32), (slice(64, 80), 8), (slice(80, 96), 8)]:
        offset = {0: 0, 64: 32, 80: 40}[rows.start]
        parts = [ranks[r][offset : offset + half] for r in range(2)]
        assert torch.equal(torch.cat(parts), full[rows])
    # Row parallel: each rank holds half the input columns and every row's scale; the partial
    # products sum to the full one (the all-reduce).
    x = torch.randn(5, 64)
    partial_sums = torch.zeros(5, 96)
    for rank in range(2):
        layer = Fp8RowParallelLinear(RowParallelLinear(64, 96, False, TensorParallel(rank, 2), torch.float32))
        layer.load(handle)
        assert torch.equal(fp8.dequantize(layer.weight, layer.weight_scale), full[:, rank * 32 : (rank + 1) * 32])
        partial_sums += fp8.fp8_linear(x[:, rank * 32 : (rank + 1) * 32], layer.weight, layer.weight_scale, False)
    torch.testing.assert_close(partial_sums, x @ full.T, rtol=1e-5, atol=1e-5)


def test_replicated_kv_heads_hold_the_same_fp8_rows(fp8_file):
    file, full, _ = fp8_file
    handle = Fp8WeightHandle(file, "w", file.get_tensor("w_scale"), None)
    k_rows = []
    for rank in range(4):  # 2 KV heads of 8 rows over 4 ranks: each held by 2 ranks
        dense = ColumnParallelLinear(64, [16], False, TensorParallel(rank, 4), torch.float32, replicas=[2])
        layer = Fp8ColumnParallelLinear(dense)
        layer.load(0, _RowView(handle, slice(0, 16)))
        k_rows.append(fp8.dequantize(layer.weight, layer.weight_scale))
    assert torch.equal(k_rows[0], k_rows[1]) and torch.equal(k_rows[2], k_rows[3])
    assert torch.equal(torch.cat([k_rows[0], k_rows[2]]), full[:16])


def test_block_scales_dequantize_but_do_not_load_as_fp8(fp8_file):
    file, _, block_scale = fp8_file
    handle = Fp8WeightHandle(file, "b", file.get_tensor("b_scale_inv"), (32, 32))
    values = file.get_tensor("b").float()
    expected = values * block_scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(handle[:], expected) and torch.equal(handle[:, 40:64], expected[:, 40:64])
    with pytest.raises(ValueError, match="no per-channel scales"):
        handle.fp8_slice(slice(None), slice(None))


class _RowView:
    """Rows ``rows`` of a handle, as a handle: one logical output of a fused checkpoint."""

    def __init__(self, handle: Fp8WeightHandle, rows: slice):
        self.handle, self.rows = handle, rows

    def fp8_slice(self, rows: slice, cols: slice):
        start = self.rows.start + (rows.start or 0)
        stop = self.rows.start + rows.stop if rows.stop is not None else self.rows.stop
        return self.handle.fp8_slice(slice(start, stop), cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_agrees_with_the_dequantizing_fallback(dtype):
    if not scaled_mm_runs_on_cpu():
        pytest.skip("torch._scaled_mm does not run on the CPU in this torch")
    from benches.gpu_check import fp8_layer_error

    error = fp8_layer_error("cpu", dtype, size=256, num_tokens=7)
    print(f"_scaled_mm vs fallback, {dtype}: max error relative to the largest output {error:.4f}")
    assert error < 0.05  # e4m3 activations carry 3 mantissa bits


def test_gpu_check_fp8_model_step_runs_on_the_cpu(tmp_path):
    """The GPU check's FP8 model step, exercised here with the CPU path it compares against."""
    if not scaled_mm_runs_on_cpu():
        pytest.skip("torch._scaled_mm does not run on the CPU in this torch")
    from benches.gpu_check import fp8_model_agreement

    same, total, error = fp8_model_agreement("cpu", torch.float32, str(tmp_path))
    assert total == 3 and error < 0.1


def test_unsupported_checkpoints_and_fp8_on_a_gguf_are_refused(tmp_path, fp8_checkpoint):
    directory = tmp_path / "gptq"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported.*compressed-tensors"):
        fp8.checkpoint_scheme(str(directory))
    packed = compressed_tensors_config("channel") | {"format": "pack-quantized"}
    (directory / "config.json").write_text(json.dumps({"quantization_config": packed}))
    with pytest.raises(ValueError, match="pack-quantized"):
        fp8.checkpoint_scheme(str(directory))
    with pytest.raises(ValueError, match="GGUF"):
        load_weights(None, ModelSource(str(tmp_path), "model.gguf"), "fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="FP8 checkpoint"):
        LLM(fp8_checkpoint[0], quantization="int8")


def test_calibrated_kv_cache_scales_are_refused_not_ignored(tmp_path):
    """A checkpoint's calibrated ``k_scale`` / ``v_scale`` (an fp8 KV cache's scales): pagedrs
    does not read them (its fp8 cache has a scale of 1.0, docs/cpu.md), so it refuses them at
    load rather than run without them."""
    directory = str(tmp_path)
    write_fp8_checkpoint(directory, tiny_hf_llama(3))
    save_word_tokenizer(directory, TINY["vocab_size"])
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected checkpoint tensor 'layers.0.self_attn.k_scale'"):
        LLM(directory, kv_cache_memory="16MiB", kv_cache_dtype="fp8")
