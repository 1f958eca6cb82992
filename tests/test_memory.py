"""Memory arithmetic: the design notes' worked examples, from the real allocator."""

import json

import pytest

from pagedrs.memory import (
    block_slack,
    dtype_bytes,
    kv_bytes_per_token,
    kv_cache_capacity,
    parse_bytes,
)

SMOLLM2_135M = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def test_blocks_and_unused_slots_of_35_17_64_tokens():
    slack = block_slack([35, 17, 64], block_size=16)
    assert slack.blocks == (3, 2, 4)
    assert slack.unused_slots == (13, 15, 0)


def test_allocated_slots_and_total_slack_of_17_33_64_tokens():
    slack = block_slack([17, 33, 64], block_size=16)
    assert slack.allocated_slots == (32, 48, 64)
    assert slack.total_slack == 30
    assert slack.total_blocks == 9


def test_block_size_one_has_no_slack():
    assert block_slack([5, 7], block_size=1).total_slack == 0


def test_kv_bytes_per_token_of_smollm2():
    # 2 (K, V) * 30 layers * 3 KV heads * 64 head dim * 2 bytes.
    assert kv_bytes_per_token(SMOLLM2_135M, "bfloat16") == 23040
    assert kv_bytes_per_token(SMOLLM2_135M, "float32") == 46080


def test_config_can_be_a_checkpoint_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2_135M, "head_dim": 128}))
    assert kv_bytes_per_token(tmp_path, "fp16") == 2 * 30 * 3 * 128 * 2


def test_blocks_that_fit_in_a_budget():
    capacity = kv_cache_capacity(SMOLLM2_135M, "1GiB", dtype="bfloat16", block_size=16)
    assert capacity.bytes_per_block == 23040 * 16
    assert capacity.num_blocks == 2**30 // (23040 * 16)
    assert capacity.num_tokens == capacity.num_blocks * 16


def test_sizes_and_dtypes_parse():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(1024) == 1024
    assert dtype_bytes("torch.bfloat16") == 2


@pytest.mark.parametrize(
    "call",
    [
        lambda: block_slack([0, 3]),
        lambda: block_slack([3], block_size=0),
        lambda: parse_bytes("lots"),
        lambda: parse_bytes(-1),
        lambda: dtype_bytes("int3"),
        lambda: kv_bytes_per_token({"num_hidden_layers": 2}),
    ],
)
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_the_default_kv_budget_grows_as_the_weights_shrink(monkeypatch):
    import torch

    from pagedrs import config

    ram = 16 * 2**30
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": ram // 4096}
    monkeypatch.setattr(config.os, "sysconf", lambda name: pages[name])
    cpu = torch.device("cpu")

    def budget(weight_bytes: int) -> int:
        return config.default_kv_cache_memory(cpu, weight_bytes)

    assert budget(0) == int(ram * config.CPU_MEMORY_SHARE)
    # Every byte the weights save goes to the cache...
    assert budget(100 * 2**20) - budget(500 * 2**20) == 400 * 2**20
    # ...and large weights keep the budget the rule gave before weights counted (5% of RAM).
    assert budget(8 * 2**30) == int(ram * 0.05)
    # Tensor-parallel ranks on the CPU share the RAM: each gets its share of the budget.
    two_ranks = config.EngineConfig(tensor_parallel_size=2)
    assert two_ranks.kv_cache_bytes(cpu, 100 * 2**20) == budget(100 * 2**20) // 2


def test_the_default_kv_budget_on_a_gpu_leaves_room_for_the_weights(monkeypatch):
    import types

    import torch

    from pagedrs import config

    total = 80 * 2**30
    properties = types.SimpleNamespace(total_memory=total)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    gpu = torch.device("cuda", 0)
    assert config.default_kv_cache_memory(gpu, 2**30) == int(total * 0.3)  # small weights: 30%
    room = int(total * config.GPU_MEMORY_SHARE) - 60 * 2**30 - config.GPU_ACTIVATION_RESERVE
    assert config.default_kv_cache_memory(gpu, 60 * 2**30) == room  # large weights: what they leave
    # Each rank of a tensor-parallel group holds its share of the weights on its own GPU.
    assert config.EngineConfig(tensor_parallel_size=4).kv_cache_bytes(gpu, 240 * 2**30) == room
    with pytest.raises(ValueError, match="leave no room"):
        config.default_kv_cache_memory(gpu, 75 * 2**30)


def test_engine_and_pagedrs_memory_agree_on_the_default_budget(tiny_llama):
    import torch

    from pagedrs.cli import build_parser
    from pagedrs.config import default_kv_cache_memory
    from pagedrs.engine.llm_engine import LLMEngine
    from pagedrs.memory_cli import predict

    prediction = predict(build_parser().parse_args(["memory", "--model", tiny_llama, "--device", "cpu"]))
    assert prediction["budget_bytes"] == default_kv_cache_memory(torch.device("cpu"), prediction["weight_bytes"])
    engine = LLMEngine(model=tiny_llama, device="cpu")
    assert engine.scheduler.num_blocks == prediction["num_blocks"]
