"""DeepSeek's multi-head latent attention beyond the families' table (tests/models/test_families.py
runs DeepSeek-V2 and V3 against transformers through every scheduling path): the cache holds
one latent per token and layer, the KV budget counts latent bytes, and the settings of
DeepSeek's configs that pagedrs does not run are refused before any weight is read."""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM
from pagedrs.layers.moe import Routing, route
from pagedrs.memory import kv_bytes_per_token, kv_cache_capacity
from tests.helpers.families import FAMILIES, save_family, save_unreadable_family
from tests.models.test_families import PROMPTS, generate

LATENT = 32 + 8  # kv_lora_rank + qk_rope_head_dim of the tiny DeepSeek configs


def test_the_cache_holds_one_latent_per_token_and_layer(tmp_path):
    save_family("deepseek-v3", tmp_path)
    config = FAMILIES["deepseek-v3"]()
    layers = config.num_hidden_layers
    # 2 layers x 40 features x 4 bytes, against 2 x 2 x 4 heads x 24 x 4 for per-head K and V.
    assert kv_bytes_per_token(tmp_path, "float32") == layers * LATENT * 4 == 320
    assert kv_bytes_per_token(tmp_path, "float32", tensor_parallel_size=2) == 320  # every rank caches every latent
    capacity = kv_cache_capacity(tmp_path, 16 * 320 * 10, "float32", block_size=16)
    assert capacity.num_blocks == 10
    llm = LLM(str(tmp_path), block_size=16, kv_cache_memory=16 * 320 * 10)
    runner = llm.engine.runner
    assert llm.engine.scheduler.stats().num_blocks == 10
    assert runner.cache_bytes_per_block == 16 * 320
    for keys, values in runner.kv_caches:
        assert keys is values  # the value cache is the key cache
        assert keys.shape[1:] == (16, 1, LATENT)
    generate(llm, PROMPTS)
    # Every cached row is a latent (RMS-normalized, then scaled by its weight) and a rotary
    # key: the rows a sequence wrote are not empty.
    assert bool(runner.kv_caches[0][0].abs().sum(dim=(1, 2, 3)).gt(0).any())
    assert llm.engine.scheduler.stats().num_used_blocks == 0


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("deepseek-v2", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("deepseek-v2", {"norm_topk_prob": True}, "norm_topk_prob is not supported for DeepSeek-V2"),
        ("deepseek-v2", {"topk_method": "noaux_tc"}, "DeepSeek-V2 routing softmax/noaux_tc"),
        ("deepseek-v3", {"scoring_func": "softmax"}, "DeepSeek-V3 routing softmax/noaux_tc"),
        ("deepseek-v3", {"n_group": 3}, "do not fall into 3 equal groups"),
        ("deepseek-v3", {"topk_group": 5}, "topk_group must be in 1..4"),
        ("deepseek-v3", {"topk_group": 1, "num_experts_per_tok": 3}, "cannot fit in 1 groups"),
    ],
    ids=["moe-layer-freq", "v2-renormalize", "v2-method", "v3-scoring", "groups", "topk-group", "top-k-in-groups"],
)
def test_deepseek_settings_pagedrs_does_not_run_are_refused(tmp_path, family, change, message):
    save_unreadable_family(family, tmp_path, change)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path))


def test_grouped_routing_chooses_only_from_the_best_groups():
    """DeepSeek-V3's router: sigmoid scores, groups ranked by their best two biased scores, the
    top-k of the kept groups weighted by their unbiased scores, renormalized and scaled."""
    torch.manual_seed(0)
    logits = torch.randn(64, 12)
    bias = torch.randn(12) * 0.3
    routing = Routing(12, 3, True, scoring="sigmoid", num_groups=4, topk_groups=2, group_score="top2_sum", scale=2.5)
    ids, weights = route(logits, routing, bias)
    scores = torch.sigmoid(logits)
    biased = (scores + bias).view(64, 4, 3)
    best_groups = biased.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for row in range(64):
        assert set((ids[row] // 3).tolist()) <= set(best_groups[row].tolist())
        allowed = [e for e in range(12) if e // 3 in best_groups[row].tolist()]
        expected = sorted(allowed, key=lambda e: -float(scores[row, e] + bias[e]))[:3]
        assert sorted(ids[row].tolist()) == sorted(expected)
        chosen = scores[row, ids[row]]
        assert torch.allclose(weights[row], chosen / chosen.sum() * 2.5)
