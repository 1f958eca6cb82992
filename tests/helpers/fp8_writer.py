"""Tiny FP8 (e4m3) checkpoints as llm-compressor and DeepSeek write them:
- `compressed_tensors_config`: the ``quantization_config`` of an FP8-dynamic model.
- `write_fp8_checkpoint`: a transformers Llama saved with e4m3 linears and their scales."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed_tensors_config(strategy: str) -> dict:
    """``quantization_config`` as llm-compressor writes an FP8-dynamic model: e4m3 weights
    with static scales per ``strategy``, activations quantized per token at run time."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def write_fp8_checkpoint(directory: str, hf_model, strategy: str = "channel") -> None:
    """Saves ``hf_model`` (a transformers Llama) as a compressed-tensors FP8 checkpoint in
    ``directory``: each decoder linear's ``weight`` as e4m3 plus ``weight_scale`` (float32
    ``[out, 1]`` per channel, ``[1]`` per tensor), everything else as stored; then sets the
    model's linears to the dequantized weights, so ``hf_model`` is the float oracle."""
    hf_model.save_pretrained(directory)
    os.remove(os.path.join(directory, "model.safetensors"))
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        if name.split(".")[-2] not in LINEARS:
            tensors[name] = tensor.contiguous()
            continue
        weight = tensor.float()
        if strategy == "block":  # DeepSeek-style: a scale per 32 x 32 block, as weight_scale_inv
            out_features, in_features = weight.shape
            blocks = weight.reshape(out_features // 32, 32, in_features // 32, 32)
            block_scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
            scale = block_scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        elif strategy == "channel":
            scale = weight.abs().amax(dim=1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
        else:
            scale = weight.abs().amax().reshape(1) / torch.finfo(torch.float8_e4m3fn).max
        values = (weight / scale).to(torch.float8_e4m3fn)
        tensors[name] = values
        if strategy == "block":
            tensors[name + "_scale_inv"] = block_scale.float()
        else:
            tensors[name + "_scale"] = scale.float()
        with torch.no_grad():
            tensor.copy_(values.float() * scale)  # the oracle holds exactly what we dequantize
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as file:
        config = json.load(file)
    if strategy == "block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [32, 32],
        }
    else:
        config["quantization_config"] = compressed_tensors_config(strategy)
    with open(config_path, "w") as file:
        json.dump(config, file)
