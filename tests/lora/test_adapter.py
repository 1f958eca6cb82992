"""LoRA adapters written by peft itself (random weights: ``init_lora_weights=False``), read
by `pagedrs.lora.load_adapter` for our fused layers: each patched linear's update equals the
peft module's output minus its base layer's, and an adapter we cannot serve exactly is
refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from pagedrs.lora import LoRARequest, load_adapter
from pagedrs.models import build_model
from tests.helpers.checkpoints import tiny_config

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OUR_LINEAR = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def _peft_adapter(directory, architecture: str = "llama", seed: int = 0, **lora):
    """A peft model over a tiny random ``architecture`` with a random adapter saved in
    ``directory``; returns the peft model (the oracle)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(tiny_config(architecture)).eval()
    settings = dict(r=8, lora_alpha=16, target_modules=ALL_MODULES, init_lora_weights=False) | lora
    model = peft.get_peft_model(base, peft.LoraConfig(**settings)).eval()
    model.save_pretrained(directory)
    return model


def _our_model(architecture: str = "llama"):
    return build_model(tiny_config(architecture), torch.float32)


def _peft_delta(peft_model, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    decoder_layer = peft_model.base_model.model.model.layers[layer]
    parent = decoder_layer.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else decoder_layer.mlp
    lora_layer = getattr(parent, module)
    with torch.no_grad():
        return lora_layer(x) - lora_layer.base_layer(x)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("rslora", [False, True])
def test_every_patched_linear_equals_peft(tmp_path, architecture, rslora):
    peft_model = _peft_adapter(tmp_path, architecture, use_rslora=rslora)
    adapter = load_adapter(LoRARequest("a", 1, str(tmp_path)), _our_model(architecture), max_lora_rank=16)
    assert adapter.rank == 8 and len(adapter.layers) == 2 * 4
    generator = torch.Generator().manual_seed(1)
    for layer in range(2):
        for module in ALL_MODULES:
            linear, part = OUR_LINEAR[module]
            weights = adapter.layers[(layer, linear)]
            x = torch.randn(5, weights.a[part].shape[1], generator=generator)
            expected = _peft_delta(peft_model, layer, module, x)
            start = sum(weights.output_sizes[:part])
            ours = weights.delta(x)[:, start : start + weights.output_sizes[part]]
            assert expected.abs().max() > 1e-3  # the adapter does change the layer
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_a_subset_of_modules_and_per_module_ranks_and_alphas(tmp_path):
    peft_model = _peft_adapter(
        tmp_path,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4},
        alpha_pattern={"down_proj": 3},
    )
    adapter = load_adapter(LoRARequest("a", 1, str(tmp_path)), _our_model(), max_lora_rank=8)
    qkv = adapter.layers[(0, "qkv_proj")]
    assert qkv.a[1] is None and qkv.b[1] is None  # k is left alone
    assert qkv.a[2].shape[0] == 4 and (0, "o_proj") not in adapter.layers
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    delta = qkv.delta(x)
    q, k, v = delta.split(qkv.output_sizes, dim=-1)
    assert k.abs().max() == 0
    torch.testing.assert_close(q, _peft_delta(peft_model, 0, "q_proj", x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, _peft_delta(peft_model, 0, "v_proj", x), rtol=1e-5, atol=1e-6)
    h = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    down = adapter.layers[(1, "down_proj")].delta(h)
    torch.testing.assert_close(down, _peft_delta(peft_model, 1, "down_proj", h), rtol=1e-5, atol=1e-6)


def _edit_config(directory, **changes) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bias": "all"}, "trains biases"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"r": 0}, "r must be a positive number"),
        ({"r": 4}, "its config says 4"),
    ],
)
def test_settings_we_would_not_apply_are_refused(tmp_path, change, message):
    _peft_adapter(tmp_path)
    _edit_config(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        load_adapter(LoRARequest("a", 1, str(tmp_path)), _our_model(), max_lora_rank=16)


def test_adapters_that_do_not_fit_are_refused(tmp_path):
    _peft_adapter(tmp_path / "r8")
    model = _our_model()
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank"):
        load_adapter(LoRARequest("a", 1, str(tmp_path / "r8")), model, max_lora_rank=4)
    other = tiny_config("llama")  # the same model but for its MLP's width
    other.intermediate_size = 96
    wrong = build_model(other, torch.float32)
    with pytest.raises(ValueError, match="trained for another model"):
        load_adapter(LoRARequest("a", 1, str(tmp_path / "r8")), wrong, max_lora_rank=16)
    with pytest.raises(ValueError, match="not a directory"):
        load_adapter(LoRARequest("a", 1, str(tmp_path / "missing")), model, max_lora_rank=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(LoRARequest("a", 1, str(tmp_path / "empty")), model, max_lora_rank=16)


def test_modules_we_do_not_patch_are_refused(tmp_path):
    _peft_adapter(tmp_path, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="does not patch a decoder layer's linear"):
        load_adapter(LoRARequest("a", 1, str(tmp_path)), _our_model(), max_lora_rank=16)


@pytest.mark.parametrize(
    ("args", "message"),
    [(("", 1, "p"), "lora_name"), (("a", 0, "p"), "lora_int_id"), (("a", True, "p"), "lora_int_id")],
)
def test_bad_lora_requests_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks over 2 KV heads: each KV head on two ranks
def test_each_tensor_parallel_rank_reads_its_shard(tmp_path, size):
    """Column-parallel linears: a rank's update is its rows of the whole update. Row-parallel
    ones: the ranks' updates of their input columns sum to the whole update."""
    from pagedrs.layers.linear import TensorParallel
    from pagedrs.lora.adapter import _shard

    _peft_adapter(tmp_path)
    request = LoRARequest("a", 1, str(tmp_path))
    whole_model = _our_model()
    whole = load_adapter(request, whole_model, max_lora_rank=8)
    ranks = [build_model(tiny_config("llama"), torch.float32, TensorParallel(rank, size)) for rank in range(size)]
    shards = [load_adapter(request, model, max_lora_rank=8) for model in ranks]
    torch.manual_seed(0)
    for key, weights in whole.layers.items():
        x = torch.randn(3, _shard(whole_model, *key).in_size)
        expected = weights.delta(x)
        parts = [(_shard(model, *key), adapter.layers[key]) for model, adapter in zip(ranks, shards)]
        if parts[0][0].row_parallel:
            total = sum(w.delta(x[:, shard.cols]) for shard, w in parts)
            torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
            continue
        starts = [sum(weights.output_sizes[:j]) for j in range(len(weights.output_sizes))]
        for shard, w in parts:
            rows = [torch.arange(start + r.start, start + r.stop) for start, r in zip(starts, shard.rows)]
            torch.testing.assert_close(w.delta(x), expected[:, torch.cat(rows)], rtol=1e-5, atol=1e-5)
