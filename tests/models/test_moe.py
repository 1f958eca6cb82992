"""Mixtures of experts beyond the families' table (tests/models/test_families.py runs Mixtral,
Qwen2-MoE, Qwen3-MoE and OLMoE against transformers through every scheduling path): GGUF files
of Mixtral (llama.cpp's ``llama`` with experts) and Qwen3-MoE with packed 3-D ``ffn_*_exps``
experts against transformers on the dequantized weights, the layer's packed and stacked
loading paths, and configs and checkpoints pagedrs must refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedrs import LLM
from pagedrs.kernels.cpu import available as cpu_kernels_available
from tests.helpers.families import FAMILIES, WINDOW, hf_greedy_logprobs, save_family
from tests.models.test_families import NEW_TOKENS, PROMPTS, assert_matches, generate

Q8_0, Q4_0, Q4_1 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1


def _moe_model(name: str):
    """The transformers model of a GGUF test: Mixtral without its window (llama.cpp's ``llama``
    files have none), Qwen3-MoE with every layer a mixture (as llama.cpp's ``qwen3moe`` runs)."""
    from transformers import AutoModelForCausalLM

    config = FAMILIES[name]()
    if name == "mixtral":
        config.sliding_window = None
    else:
        config.decoder_sparse_step, config.mlp_only_layers = 1, []
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4)
    return model


def _dequantized_in_place(model, types: dict[str, GGMLQuantizationType]) -> None:
    """Replaces the experts' weights by their quantize-dequantize round trip (what the GGUF file
    will hold), so transformers runs the file's values; each round trip must be exact."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if ".mlp.experts." not in name:
                continue
            layer = int(name.split(".")[2])
            halves = [(f"blk.{layer}.ffn_down_exps", tensor)]
            if name.endswith("gate_up_proj"):
                half = tensor.shape[1] // 2
                halves = [
                    (f"blk.{layer}.ffn_gate_exps", tensor[:, :half]),
                    (f"blk.{layer}.ffn_up_exps", tensor[:, half:]),
                ]
            for gguf_name, part in halves:
                qtype = types.get(gguf_name)
                if qtype is None:
                    continue
                packed = quants.quantize(part.numpy(), qtype)
                values = quants.dequantize(packed, qtype)
                assert np.array_equal(quants.quantize(values, qtype), packed)  # the file holds exactly these
                part.copy_(torch.from_numpy(values))


@pytest.mark.skipif(not cpu_kernels_available(), reason="packed experts run on the CPU kernel")
@pytest.mark.parametrize(("name", "architecture"), [("mixtral", "llama"), ("qwen3-moe", "qwen3moe")])
def test_gguf_with_packed_experts_matches_hugging_face(tmp_path, name, architecture):
    from tests.helpers.gguf_writer import write_gguf

    model = _moe_model(name)
    types = {
        "blk.0.ffn_gate_exps": Q8_0,
        "blk.0.ffn_up_exps": Q8_0,
        "blk.0.ffn_down_exps": Q4_0,
        "blk.1.ffn_gate_exps": Q4_1,
        "blk.1.ffn_up_exps": Q4_1,
        "blk.1.ffn_down_exps": Q8_0,
    }
    _dequantized_in_place(model, types)
    oracle = {tuple(prompt): hf_greedy_logprobs(model, prompt, NEW_TOKENS) for prompt in PROMPTS}
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(path, model, types, architecture=architecture)
    llm = LLM(path)
    engine = llm.engine
    assert type(engine.model.config).__name__ == type(model.config).__name__
    assert engine.runner.cpu_stack is not None
    for index, layer in enumerate(engine.model.layers):
        experts = layer.mlp.experts
        assert type(experts).__name__ == "QuantFusedExperts"
        assert experts.down_type == int(types[f"blk.{index}.ffn_down_exps"])
    for prompt, output in zip(PROMPTS, generate(llm, PROMPTS)):
        assert_matches(f"{name} gguf", oracle, prompt, output.outputs[0])
    # The Python layers (the same fused kernel, the router in torch) agree with the stack.
    python_layers = LLM(path, attention_backend="torch")
    for prompt, output in zip(PROMPTS, generate(python_layers, PROMPTS)):
        assert_matches(f"{name} gguf, Python layers", oracle, prompt, output.outputs[0])


def test_int8_quantizes_a_float_checkpoints_experts(tmp_path):
    """``quantization="int8"`` packs the experts (and the shared expert) as Q8_0 too; the tokens
    stay those of the float model on this tiny checkpoint."""
    save_family("qwen2-moe", tmp_path)
    packed, dense = LLM(str(tmp_path), quantization="int8"), LLM(str(tmp_path))
    mlp = packed.engine.model.layers[0].mlp
    assert type(mlp.experts).__name__ == "QuantFusedExperts"
    assert type(mlp.shared_expert.gate_up_proj).__name__ == "QuantColumnParallelLinear"
    ours, theirs = generate(packed, PROMPTS), generate(dense, PROMPTS)
    agree = sum(a.outputs[0].token_ids[:8] == b.outputs[0].token_ids[:8] for a, b in zip(ours, theirs))
    assert agree >= 1


def _rewrite_config(directory, **change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(change)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("mixtral", {"num_experts_per_tok": 6}, "num_experts_per_tok must be in 1..5"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv is not supported"),
        ("qwen3-moe", {"hidden_act": "relu"}, "activation 'relu' is not supported"),
    ],
    ids=["top-k-above-experts", "clip-qkv", "activation"],
)
def test_moe_configs_pagedrs_does_not_run_are_refused(tmp_path, family, change, message):
    save_family(family, tmp_path)
    _rewrite_config(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path))


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_family("olmoe", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.mlp.experts.4.up"):
        LLM(str(tmp_path))


def test_stacked_expert_tensors_load_like_per_expert_ones(tmp_path):
    """transformers' stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` (the in-memory layout,
    which some checkpoints store) load into the same weights as the per-expert tensors."""
    from safetensors.torch import save_file

    model = save_family("mixtral", tmp_path / "per-expert")
    stacked_dir = tmp_path / "stacked"
    model.save_pretrained(stacked_dir)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    state["lm_head.weight"] = model.lm_head.weight.detach().contiguous()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    for path in stacked_dir.glob("*.safetensors"):
        path.unlink()
    save_file(state, stacked_dir / "model.safetensors", metadata={"format": "pt"})
    for file in (tmp_path / "per-expert").iterdir():
        if file.suffix != ".safetensors" and not (stacked_dir / file.name).exists():
            (stacked_dir / file.name).write_bytes(file.read_bytes())
    a, b = LLM(str(tmp_path / "per-expert")), LLM(str(stacked_dir))
    for layer_a, layer_b in zip(a.engine.model.layers, b.engine.model.layers):
        assert torch.equal(layer_a.mlp.experts.gate_up, layer_b.mlp.experts.gate_up)
        assert torch.equal(layer_a.mlp.experts.down, layer_b.mlp.experts.down)
        assert torch.equal(layer_a.mlp.gate, layer_b.mlp.gate)
    assert WINDOW == a.engine.model.layer_windows[0]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_expert_token_counts_cover_every_routed_token(tmp_path, backend):
    """Each mixture layer counts the (token, slot) pairs it routes (the decoder stack and the
    Python layers alike), and the metrics page reports them per layer and expert."""
    from types import SimpleNamespace

    from prometheus_client.core import CounterMetricFamily

    from pagedrs.server.metrics import _SchedulerCollector

    save_family("qwen3-moe", tmp_path)  # layer 0 dense, layer 1 a mixture of 8 experts, top 4
    llm = LLM(str(tmp_path), attention_backend=backend)
    outputs = generate(llm, PROMPTS)
    computed = sum(len(prompt) + NEW_TOKENS - 1 for prompt in PROMPTS)  # the last token is never fed back
    counts = llm.engine.runner.expert_tokens()
    assert list(counts) == [1] and counts[1].shape == (8,)
    assert int(counts[1].sum()) == computed * 4
    assert len(outputs) == len(PROMPTS)
    collector = _SchedulerCollector(SimpleNamespace(expert_tokens=llm.engine.runner.expert_tokens), "tiny")
    (family,) = list(collector._experts())
    assert isinstance(family, CounterMetricFamily) and family.name == "pagedrs:moe_expert_tokens"
    samples = {(s.labels["layer"], s.labels["expert"]): s.value for s in family.samples}
    assert sum(samples.values()) == computed * 4 and ("1", "7") in samples


def test_gpt_oss_sinks_and_clamp_are_what_makes_it_match(tmp_path):
    """The families' table runs gpt-oss against transformers; here each of its specifics is
    shown to matter: without the sinks, or without the clamp, the logprobs move off the oracle's."""
    from pagedrs.layers.moe import Activation

    model = save_family("gpt-oss", tmp_path)
    prompt = PROMPTS[0]
    tokens, logprobs, _ = hf_greedy_logprobs(model, prompt, 4)
    llm = LLM(str(tmp_path))
    assert llm.engine.runner.cpu_stack is not None
    layers = llm.engine.model.layers

    def worst_gap(engine: LLM = llm) -> float:
        """The largest logprob difference from the oracle's (inf once a token differs)."""
        completion = generate(engine, [prompt])[0].outputs[0]
        worst = 0.0
        for i, token in enumerate(tokens):
            if completion.token_ids[i] != token:
                return float("inf")
            worst = max(worst, abs(completion.logprobs[i][token].logprob - logprobs[i]))
        return worst

    assert worst_gap() < 1e-4
    saved = [layer.self_attn.sinks.clone() for layer in layers]
    for layer in layers:
        layer.self_attn.sinks.fill_(-1e4)  # no sink: exp(-1e4) is 0
    assert worst_gap() > 1e-3
    for layer, sinks in zip(layers, saved):
        layer.self_attn.sinks.copy_(sinks)
    python_layers = LLM(str(tmp_path), attention_backend="torch")
    for layer in python_layers.engine.model.layers:
        layer.mlp.experts.activation = Activation("swiglu_oai", layer.mlp.experts.activation.alpha, 1e4)
    assert worst_gap(python_layers) > 1e-3


def test_gpt_oss_mxfp4_experts_are_dequantized_at_load(tmp_path):
    """A gpt-oss checkpoint as released (``quant_method: mxfp4``: each expert tensor as
    ``_blocks`` and ``_scales``) loads dequantized and matches transformers running the weights
    transformers' own MXFP4 conversion gives."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagedrs.quant.mxfp4 import dequantize

    model = save_family("gpt-oss", tmp_path)
    generator = torch.Generator().manual_seed(7)
    weights = load_file(tmp_path / "model.safetensors")
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            experts = model.model.layers[layer].mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)  # [E, C, R]: stored as blocks of R rows of C
                num_experts, cols, rows = param.shape
                blocks = torch.randint(
                    0, 256, (num_experts, rows, cols // 32, 16), dtype=torch.uint8, generator=generator
                )
                scales = torch.randint(
                    118, 124, (num_experts, rows, cols // 32), dtype=torch.uint8, generator=generator
                )
                values = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                assert torch.equal(values, dequantize(blocks, scales))
                param.copy_(values)
                key = f"model.layers.{layer}.mlp.experts.{name}"
                del weights[key]
                weights[f"{key}_blocks"], weights[f"{key}_scales"] = blocks, scales
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    oracle = {tuple(prompt): hf_greedy_logprobs(model, prompt, NEW_TOKENS) for prompt in PROMPTS}
    llm = LLM(str(tmp_path))
    for prompt, output in zip(PROMPTS, generate(llm, PROMPTS)):
        assert_matches("gpt-oss mxfp4", oracle, prompt, output.outputs[0])
    del weights["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_scales"):
        LLM(str(tmp_path))
