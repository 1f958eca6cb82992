"""KV cache memory arithmetic: block slack, KV bytes per token, blocks in a budget.

Slack comes out of the real allocator (``KVCacheManager``), not a separate formula, so
what this module reports is what the engine will do:

>>> block_slack([35, 17, 64], block_size=16).unused_slots
(13, 15, 0)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedrs._core import KVCacheManager
from pagedrs.errors import InvalidArgumentError

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class BlockSlack:
    """How a set of independent sequences (no prefix sharing) lands in blocks."""

    block_size: int
    lengths: tuple[int, ...]
    """Tokens per sequence."""
    blocks: tuple[int, ...]
    """Blocks each sequence holds."""
    allocated_slots: tuple[int, ...]
    """Token slots each sequence holds (``blocks * block_size``)."""

    @property
    def unused_slots(self) -> tuple[int, ...]:
        """Slots allocated but not filled, per sequence (tail waste)."""
        return tuple(a - n for a, n in zip(self.allocated_slots, self.lengths))

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks)

    @property
    def total_allocated_slots(self) -> int:
        return sum(self.allocated_slots)

    @property
    def total_slack(self) -> int:
        """Unused slots over all sequences."""
        return sum(self.unused_slots)


def block_slack(lengths: Sequence[int], block_size: int = 16) -> BlockSlack:
    """Allocates each sequence in a fresh ``KVCacheManager`` and reports what it holds."""
    lengths = tuple(_positive_int(n, "sequence length") for n in lengths)
    block_size = _positive_int(block_size, "block_size")
    # An upper bound on what the allocator can need (each sequence wastes < 1 block).
    num_blocks = sum(n // block_size + 1 for n in lengths) or 1
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    blocks = []
    for index, length in enumerate(lengths):
        request_id = f"seq-{index}"
        manager.add_request(request_id, [0] * length)
        if manager.allocate_slots(request_id, length) is None:
            raise AssertionError("block_slack sized its pool too small")  # a bug, not input
        blocks.append(len(manager.block_table(request_id)))
    return BlockSlack(
        block_size=block_size,
        lengths=lengths,
        blocks=tuple(blocks),
        allocated_slots=tuple(b * block_size for b in blocks),
    )


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype name (``"bfloat16"``) or a ``torch.dtype``."""
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_BYTES:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; expected one of {', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[name]


def kv_bytes_per_token(config: Any, dtype: Any = "bfloat16", tensor_parallel_size: int = 1) -> int:
    """Bytes of key and value cache one token takes over all layers, on one rank.

    ``config`` is a Hugging Face config (object or dict), a ``config.json`` path or a
    checkpoint directory. ``2 (K and V) * layers * kv_heads * head_dim * dtype bytes``, where a
    tensor-parallel rank holds ``kv_heads / tensor_parallel_size`` heads (one when there are
    fewer heads than ranks: they are replicated). Latent attention (DeepSeek's ``kv_lora_rank``)
    caches ``layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes``, on every rank.
    """
    fields = _config_fields(config)
    num_layers = _config_int(fields, "num_hidden_layers")
    tensor_parallel_size = _positive_int(tensor_parallel_size, "tensor_parallel_size")
    if fields.get("kv_lora_rank"):
        # Latent attention (DeepSeek, `pagedrs.models.mla`): one latent per token and layer,
        # the same on every rank.
        latent = _config_int(fields, "kv_lora_rank") + _config_int(fields, "qk_rope_head_dim")
        return num_layers * latent * dtype_bytes(dtype)
    num_heads = _config_int(fields, "num_attention_heads")
    num_kv_heads = _config_int(fields, "num_key_value_heads", default=num_heads)
    head_dim = fields.get("head_dim")
    if head_dim is None:
        head_dim = _config_int(fields, "hidden_size") // num_heads
    heads_per_rank = max(1, num_kv_heads // tensor_parallel_size)
    return 2 * num_layers * heads_per_rank * int(head_dim) * dtype_bytes(dtype)


@dataclass(frozen=True)
class KVCapacity:
    """What a memory budget holds for one model, dtype and block size."""

    bytes_per_token: int
    """Keys and values of one token in every layer (a draft model's included): what full
    attention stores per token."""
    bytes_per_block: int
    """One block id's memory: ``block_size`` tokens of the layers a block holds."""
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        """Token slots in all blocks."""
        return self.num_blocks * self.block_size


def kv_cache_capacity(
    config: Any,
    budget: int | str,
    dtype: Any = "bfloat16",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    draft_config: Any = None,
    num_layer_slots: int | None = None,
) -> KVCapacity:
    """How many blocks of ``block_size`` tokens fit in ``budget`` bytes (or ``"4GiB"``) on
    each rank. A block holds ``num_layer_slots`` layers' keys and values (default: every
    layer; fewer for a model with sliding-window layers, whose layer groups take blocks of
    their own: `pagedrs.engine.kv_layout`). A draft model's (``draft_config``, one rank) KV
    lives in the same blocks, so each token also holds its keys and values."""
    block_size = _positive_int(block_size, "block_size")
    budget_bytes = parse_bytes(budget)
    per_token = kv_bytes_per_token(config, dtype, tensor_parallel_size)
    per_slot_token = per_token
    if num_layer_slots is not None:
        num_layers = _config_int(_config_fields(config), "num_hidden_layers")
        per_slot_token = per_token // num_layers * _positive_int(num_layer_slots, "num_layer_slots")
    if draft_config is not None:
        draft_per_token = kv_bytes_per_token(draft_config, dtype)
        per_token += draft_per_token
        per_slot_token += draft_per_token
    per_block = per_slot_token * block_size
    return KVCapacity(
        bytes_per_token=per_token,
        bytes_per_block=per_block,
        num_blocks=budget_bytes // per_block,
        block_size=block_size,
    )


def parse_bytes(size: int | str) -> int:
    """``4096``, ``"4GiB"``, ``"1.5 GB"`` or ``"512MiB"`` as a number of bytes."""
    if isinstance(size, bool):
        raise InvalidArgumentError(f"not a memory size: {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _BYTE_UNITS:
            raise InvalidArgumentError(f"not a memory size: {size!r} (write e.g. 4GiB, 512MiB, 2GB or a byte count)")
        value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value < 0:
        raise InvalidArgumentError(f"memory size must be >= 0, got {size!r}")
    return value


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def _config_fields(config: Any) -> Mapping[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    if isinstance(config, Mapping):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return vars(config)


def _config_int(fields: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = fields.get(name, default)
    if value is None:
        raise InvalidArgumentError(f"model config has no {name!r}")
    return int(value)
