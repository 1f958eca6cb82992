"""The batched LoRA update (`LoRASlots.add` over a `LoRABatch`) against a per-row reference:
each row's output plus its own adapter's ``B (A x)`` (`LoRAWeights.delta`), for ranks 1..64,
several adapters in one batch, rows without an adapter, slots no row uses, and adapters
that patch only some slices of a fused linear."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.lora import LINEARS, LoRAAdapter, LoRAWeights
from pagedrs.lora.adapter import _base_shapes
from pagedrs.lora.slots import LoRABatch, LoRASlots
from pagedrs.models import build_model
from tests.helpers.checkpoints import tiny_config


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config("llama"), torch.float32)


def _random_adapter(model, name: str, rank: int, seed: int, skip_slice: int | None = None) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(seed)
    adapter = LoRAAdapter(name, "", rank)
    for layer in range(len(model.decoder_layers())):
        for linear in LINEARS:
            in_size, sizes = _base_shapes(model, layer, linear)
            a = [torch.randn(rank, in_size, generator=generator) / in_size**0.5 for _ in sizes]
            b = [torch.randn(size, rank, generator=generator) for size in sizes]
            if skip_slice is not None and len(sizes) > 1:
                a[skip_slice] = b[skip_slice] = None
            adapter.layers[(layer, linear)] = LoRAWeights(sizes, a, b)  # type: ignore[arg-type]
    return adapter


@pytest.mark.parametrize("ranks", [(1, 1, 1), (8, 16, 4), (64, 2, 33)])
def test_the_batched_update_equals_each_rows_own_adapter(model, ranks):
    adapters = [
        _random_adapter(model, f"a{i}", rank, seed=i, skip_slice=1 if i == 1 else None) for i, rank in enumerate(ranks)
    ]
    slots = LoRASlots(model, max_loras=4, max_rank=64, device=torch.device("cpu"), dtype=torch.float32)
    for slot, adapter in enumerate(adapters):
        slots.load(slot, adapter)
    # 11 rows: adapters 0, 1, 2 and none mixed, slot 3 loaded by nobody.
    row_slots = np.array([0, -1, 2, 1, 1, -1, 0, 2, 2, -1, 0])
    batch = LoRABatch.of(row_slots, torch.device("cpu"))
    assert batch is not None and [slot for slot, _ in batch.groups] == [0, 1, 2]
    generator = torch.Generator().manual_seed(99)
    for key in [(0, "qkv_proj"), (1, "o_proj"), (0, "gate_up_proj"), (1, "down_proj")]:
        in_size, sizes = _base_shapes(model, *key)
        x = torch.randn(len(row_slots), in_size, generator=generator)
        base = torch.randn(len(row_slots), sum(sizes), generator=generator)
        expected = base.clone()
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                expected[row] += adapters[slot].layers[key].delta(x[row : row + 1])[0]
        got = slots.add(key, x, base.clone(), batch)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        untouched = row_slots < 0
        assert torch.equal(got[untouched], base[untouched])


def test_no_adapter_rows_make_no_batch_and_slots_are_bounded(model):
    assert LoRABatch.of(np.array([-1, -1]), torch.device("cpu")) is None
    slots = LoRASlots(model, max_loras=2, max_rank=8, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="above max_lora_rank"):
        slots.load(0, _random_adapter(model, "big", 16, seed=0))
    with pytest.raises(ValueError, match="not one of the 2 slots"):
        slots.load(2, _random_adapter(model, "small", 4, seed=0))
    # Reloading a slot leaves nothing of the adapter before it.
    slots.load(0, _random_adapter(model, "first", 8, seed=1))
    second = _random_adapter(model, "second", 2, seed=2)
    slots.load(0, second)
    assert slots.a[(0, "qkv_proj")][0, :, 2:].abs().max() == 0
    x = torch.randn(3, 64)
    batch = LoRABatch.of(np.array([0, 0, 0]), torch.device("cpu"))
    assert batch is not None
    got = slots.add((0, "qkv_proj"), x, torch.zeros(3, 128), batch)
    torch.testing.assert_close(got, second.layers[(0, "qkv_proj")].delta(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [(1, 64, 7), (16, 16, 16)])
def test_the_compiled_stack_adds_what_the_python_layers_add(tiny_llama, ranks):
    """The CPU decoder stack's update (rows of one adapter together; an adapter with many rows
    through ATen) against the Python layers' `LoRASlots.add`: a mixed step (decodes, a
    40-row prompt, chunks) whose sequences use three adapters or none, a slot nobody uses,
    and a step of decodes only."""
    from pagedrs.kernels.cpu import available
    from pagedrs.lora.manager import LoRAManager
    from tests.models.test_decoder_stack import MIXED, forward_both, runner_for

    if not available():
        pytest.skip("the CPU kernels do not build here")
    runner = runner_for(tiny_llama)
    assert runner.cpu_stack is not None
    runner.lora = LoRAManager(runner.model, 4, 64, None, torch.device("cpu"), torch.float32)
    runner.cpu_stack.attach_lora(runner.lora.slots)
    for slot, rank in enumerate(ranks):
        runner.lora.slots.load(slot, _random_adapter(runner.model, f"a{slot}", rank, seed=slot, skip_slice=slot % 2))
    # Per sequence of MIXED: its slot (the 40- and 33-row chunks are one adapter's 73 rows).
    seq_slots = [0, -1, 1, 1, 2, 0, -1]
    for seqs in (MIXED, [(context, 1) for context, _ in MIXED]):
        lora_rows = np.repeat(np.array(seq_slots, dtype=np.int64), [rows for _, rows in seqs])
        (stack_logits, _), (layer_logits, _) = forward_both(runner, seqs, lora_rows=lora_rows)
        (plain_logits, _), _ = forward_both(runner, seqs)
        torch.testing.assert_close(stack_logits, layer_logits, atol=1e-4, rtol=1e-4)
        with_adapter = torch.from_numpy(lora_rows >= 0)
        assert not torch.allclose(stack_logits[with_adapter], plain_logits[with_adapter], atol=1e-3)
        torch.testing.assert_close(stack_logits[~with_adapter], plain_logits[~with_adapter], atol=1e-4, rtol=1e-4)
