"""The Triton LoRA kernels (`pagedrs.lora.triton_kernels`, one program per row) against the
torch ops they replace, through Triton's interpreter on the CPU: ranks 1..64, several
adapters in one batch, rows without an adapter, slots no row uses, and slices an adapter
leaves alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.kernels import triton as triton_runtime
from pagedrs.layers import fused
from pagedrs.lora.adapter import _base_shapes
from pagedrs.lora.slots import LoRABatch, LoRASlots
from pagedrs.models import build_model
from tests.helpers.checkpoints import tiny_config
from tests.lora.test_slots import _random_adapter

if not triton_runtime.available():
    pytest.skip("Triton is not installed here", allow_module_level=True)

pytestmark = pytest.mark.slow  # Triton's interpreter on the CPU; make gpu-check compiles them

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("ranks", [(1, 1), (16, 4), (64, 33)])
def test_the_kernels_equal_the_torch_update(ranks):
    model = build_model(tiny_config("llama"), torch.float32)
    slots = LoRASlots(model, max_loras=3, max_rank=64, device=DEVICE, dtype=torch.float32)
    for slot, rank in enumerate(ranks):
        slots.load(slot, _random_adapter(model, f"a{slot}", rank, seed=slot, skip_slice=0 if slot else None))
    row_slots = np.array([1, -1, 0, 0, -1, 1, 1])  # slot 2 is loaded by nobody
    batch = LoRABatch.of(row_slots, DEVICE)
    assert batch is not None
    generator = torch.Generator().manual_seed(7)
    for key in [(0, "qkv_proj"), (1, "o_proj"), (0, "gate_up_proj"), (1, "down_proj")]:
        in_size, sizes = _base_shapes(model, *key)
        x = torch.randn(len(row_slots), in_size, generator=generator).to(DEVICE)
        base = torch.randn(len(row_slots), sum(sizes), generator=generator).to(DEVICE)
        fused.set_enabled(False)
        expected = slots.add(key, x, base.clone(), batch)
        fused.set_enabled(True)
        try:
            got = slots.add(key, x, base.clone(), batch)
        finally:
            fused.set_enabled(None)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        none = torch.from_numpy(row_slots < 0).to(DEVICE)
        assert torch.equal(got[none], base[none])
