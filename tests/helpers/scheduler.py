"""The core `Scheduler` built as the engine builds it: settings from an `EngineConfig`."""

from __future__ import annotations

from typing import Any

from pagedrs import Scheduler
from pagedrs.config import EngineConfig
from pagedrs.spec_decode import SpeculativeConfig


def make_scheduler(
    num_blocks: int,
    *,
    max_model_len: int = 8192,
    speculative: SpeculativeConfig | None = None,
    kv_group_windows: list[int | None] | None = None,
    **settings: Any,
) -> Scheduler:
    """A scheduler over ``num_blocks`` KV blocks.

    - ``settings``: `EngineConfig` fields (``block_size``, ``max_num_seqs``,
      ``scheduling_policy``, ...), its defaults for the rest;
    - ``max_model_len``: 8192 unless given;
    - ``kv_group_windows``: the KV layer groups' windows (default: one full group).
    """
    return Scheduler(
        EngineConfig(**settings),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        speculative=speculative,
        kv_group_windows=kv_group_windows,
    )
