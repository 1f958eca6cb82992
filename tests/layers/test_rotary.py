"""The RoPE factory against transformers' own rotary code: each variant's frequencies and
attention factor (`ROPE_INIT_FUNCTIONS`), and the length-dependent variants' choice by length,
for both config spellings (``rope_parameters`` and the legacy ``rope_scaling``)."""

from __future__ import annotations

import types

import pytest
import torch

from pagedrs.layers.rotary import DynamicNTKRope, LongRope, apply_rotary, get_rope, model_positions, rope_lengths
from tests.helpers.families import FAMILIES


def hf_frequencies(config, seq_len=None, layer_type=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    if params["rope_type"] == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len, **kwargs)


@pytest.mark.parametrize("name", [n for n in FAMILIES if not n.startswith("gemma3")])
def test_frequencies_and_attention_factor_equal_transformers(name):
    config = FAMILIES[name]()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = get_rope(config, head_dim)
    inv_freq, factor = hf_frequencies(config)
    torch.testing.assert_close(rope.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(factor)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n.startswith("gemma3")])
def test_gemma3_has_one_rotary_per_layer_type(name):
    config = FAMILIES[name]()
    for layer_type in ("sliding_attention", "full_attention"):
        rope = get_rope(config, 16, layer_type)
        torch.testing.assert_close(rope.inv_freq, hf_frequencies(config, layer_type=layer_type)[0], rtol=1e-6, atol=0)


def test_longrope_and_dynamic_follow_the_length_as_transformers_does():
    longrope_config = FAMILIES["phi3-longrope"]()
    rope = get_rope(longrope_config, 16)
    assert isinstance(rope, LongRope)
    positions = torch.tensor([3, 40, 3])
    lengths = torch.tensor([32, 41, 33])  # at the threshold, past it, just past it
    cos, _ = rope.cos_sin(positions, torch.float32, lengths)
    for row, length in enumerate(lengths.tolist()):
        inv_freq, factor = hf_frequencies(longrope_config, seq_len=length)
        freqs = positions[row].float() * inv_freq
        torch.testing.assert_close(cos[row], torch.cat((freqs, freqs)).cos() * factor, rtol=1e-6, atol=1e-6)
    dynamic_config = FAMILIES["llama-dynamic"]()
    rope = get_rope(dynamic_config, 16)
    assert isinstance(rope, DynamicNTKRope)
    frequencies = rope.frequencies_at(torch.tensor([10, 32, 33, 90]))
    for row, length in enumerate([10, 32, 33, 90]):
        torch.testing.assert_close(
            frequencies[row], hf_frequencies(dynamic_config, seq_len=length)[0], rtol=1e-6, atol=0
        )


def test_lengths_are_the_prompt_or_the_position():
    import numpy as np

    # A 5-token prompt's chunk of 3 (positions 0-2), a decode at position 9 of a 6-token prompt.
    lengths = rope_lengths(np.array([0, 1, 2, 9]), np.array([0, 3, 4]), np.array([5, 6], dtype=np.int32))
    assert lengths.tolist() == [5, 5, 5, 10]


def test_legacy_rope_scaling_spelling_is_read():
    legacy = types.SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=100,
        rope_parameters=None,
    )
    rope = get_rope(legacy, 8)
    base = 1.0 / (500000.0 ** (torch.arange(0, 8, 2).float() / 8))
    torch.testing.assert_close(rope.inv_freq, base / 2)
    assert model_positions(legacy) == 200


def test_partial_rotation_passes_the_rest_through():
    x = torch.randn(3, 2, 16)
    cos, sin = torch.ones(3, 8) * 0.5, torch.ones(3, 8) * 0.25
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.equal(out[..., :8], x[..., :8])
