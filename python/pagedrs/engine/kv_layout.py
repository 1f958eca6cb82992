"""`KVLayout`: how a model's layers share the KV blocks, so sliding-window layers hold only
their window.

The core keeps one block table per *layer group* and sequence (``kv_group_windows`` of the
Rust ``SchedulerConfig``): a full-attention group holds every block of the sequence, a
sliding group releases each block once no query can see it again (vLLM's hybrid KV cache
manager does the same). All groups draw from one pool. For the blocks to be interchangeable,
every group has the same number of layers, ``num_slots``, and the cache is ``num_slots``
tensor pairs of ``[num_blocks, block_size, kv_heads, head_dim]``: layer ``l`` reads and writes
pair ``layer_slots[l]`` at the blocks of its group ``layer_groups[l]``. So one block id is
``num_slots`` layers' worth of memory, owned by one group at a time.

Gemma 3 (5 sliding layers per global one, 6k layers) gets ``num_slots = k``: one full group
and five sliding groups of ``k`` layers each; Gemma 2 (alternating) two groups of ``L / 2``; a
model without sliding layers one group of all its layers, exactly the cache it had before.

::

    layers     0  1  2  3  4  5 | 6  7  8  9 10 11      (Gemma 3, k = 2: 5 and 11 are global)
    group      1  2  3  4  5  0 | 1  2  3  4  5  0      group 0: full; 1..5: window W
    slot       0  0  0  0  0  0 | 1  1  1  1  1  1

An *attention view* is what a layer's attention metadata depends on: its group (the block
tables and slot mapping it reads) and its window (the mask). Most models have one view;
metadata is built once per view per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_GROUPS = 64
"""The most layer groups the core takes (``MAX_GROUPS`` in ``kv_cache_manager.rs``)."""
_MAX_SLIDING_PADDING = 1 / 8
"""Most of the sliding groups' slots left unused (when their layers do not divide evenly) that
`KVLayout.plan` accepts before it tries a smaller group size."""


@dataclass(frozen=True)
class KVLayout:
    """See the module docstring."""

    group_windows: tuple[int | None, ...]
    """Each layer group's window (``None``: full attention), group 0 first: what the core's
    scheduler takes as ``kv_group_windows``."""
    layer_groups: tuple[int, ...]
    """The group of each layer."""
    layer_slots: tuple[int, ...]
    """Which of the ``num_slots`` cache tensor pairs each layer uses."""
    num_slots: int
    """Cache tensor pairs: layers' worth of memory per block."""
    views: tuple[tuple[int, int | None], ...]
    """The distinct ``(group, window)`` the layers attend with, in layer order."""
    layer_views: tuple[int, ...]
    """The view of each layer (an index of ``views``)."""

    @classmethod
    def plan(cls, layer_windows: Sequence[int | None], release_windows: bool = True) -> KVLayout:
        """The layout for layers with these windows (``None``: full attention).

        Sliding layers get groups of their own when ``release_windows`` and the model has
        full-attention layers too (the other groups' cached blocks are confirmed against the
        full group's chain), or when every layer has the same window (one group that
        releases). Otherwise (a draft model sharing the blocks needs them all, or the layers
        mix windows without a full one) one full group holds every layer, each attending with
        its own window over blocks that are never released."""
        windows = list(layer_windows)
        if not windows:
            raise ValueError("a model needs at least one layer")
        kinds = list(dict.fromkeys(windows))
        if len(kinds) == 1 and (kinds[0] is None or release_windows):
            return cls._grouped(kinds, [list(range(len(windows)))], len(windows))
        if not release_windows or None not in kinds:
            return cls._single(windows)
        kinds.remove(None)
        kinds.insert(0, None)
        layers_of = [[i for i, window in enumerate(windows) if window == kind] for kind in kinds]
        num_full = len(layers_of[0])
        sliding = [len(layers) for layers in layers_of[1:]]
        size = next(
            (
                size
                for size in range(min(len(layers) for layers in layers_of), 0, -1)
                if num_full % size == 0
                and sum(math.ceil(n / size) * size - n for n in sliding) <= _MAX_SLIDING_PADDING * sum(sliding)
                and num_full // size + sum(math.ceil(n / size) for n in sliding) <= MAX_GROUPS
            ),
            None,
        )
        return cls._single(windows) if size is None else cls._grouped(kinds, layers_of, size)

    @classmethod
    def _single(cls, windows: list[int | None]) -> KVLayout:
        views = tuple(dict.fromkeys((0, window) for window in windows))
        return cls(
            group_windows=(None,),
            layer_groups=(0,) * len(windows),
            layer_slots=tuple(range(len(windows))),
            num_slots=len(windows),
            views=views,
            layer_views=tuple(views.index((0, window)) for window in windows),
        )

    @classmethod
    def _grouped(cls, kinds: list[int | None], layers_of: list[list[int]], size: int) -> KVLayout:
        """Groups of ``size`` layers: ``layers_of[i]`` (the layers with window ``kinds[i]``)
        split in order, the last group of a kind possibly short."""
        num_layers = sum(len(layers) for layers in layers_of)
        group_windows: list[int | None] = []
        layer_groups = [0] * num_layers
        layer_slots = [0] * num_layers
        for kind, layers in zip(kinds, layers_of):
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_groups[layer] = len(group_windows)
                    layer_slots[layer] = slot
                group_windows.append(kind)
        pairs = [(group, group_windows[group]) for group in layer_groups]
        views = tuple(dict.fromkeys(pairs))
        return cls(
            group_windows=tuple(group_windows),
            layer_groups=tuple(layer_groups),
            layer_slots=tuple(layer_slots),
            num_slots=size,
            views=views,
            layer_views=tuple(views.index(pair) for pair in pairs),
        )

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def final_blocks(group_windows: Sequence[int | None], length: int, block_size: int) -> int:
    """Blocks a sequence of ``length`` tokens holds in all groups once the last of them is
    computed by a decode (what it holds from then on until its next token)."""
    if length < 1:
        return 0
    full = math.ceil(length / block_size)
    position = length - 1  # the last query: blocks before its window are released
    return sum(
        full if window is None else full - max(0, position + 1 - window) // block_size for window in group_windows
    )


def decode_peak_blocks(group_windows: Sequence[int | None], prompt_len: int, length: int, block_size: int) -> int:
    """The most blocks a sequence holds while it decodes from a ``prompt_len``-token prompt up
    to ``length`` tokens (a sliding group's count goes up and down by one as blocks fill and
    leave its window)."""
    lengths = range(max(1, prompt_len), max(1, length) + 1)
    return max(final_blocks(group_windows, n, block_size) for n in lengths)
