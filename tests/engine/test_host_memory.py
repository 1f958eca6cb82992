"""The weights in huge pages (`place_in_huge_pages`): every CPU parameter and buffer moves into
one mapping advised for 2 MiB pages, with its values, identity and sharing intact, and an
engine's model is placed there at load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedrs import LLM, SamplingParams
from pagedrs.engine import host_memory
from pagedrs.engine.host_memory import place_in_huge_pages

pytestmark = pytest.mark.skipif(
    not host_memory._huge_pages_available(), reason="no transparent huge pages here (Linux, madvise or always)"
)


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 600)
        self.head = nn.Linear(600, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter
        self.proj = nn.Linear(600, 1200)
        self.register_buffer("table", torch.arange(3000, dtype=torch.float64).reshape(1000, 3))
        self.register_buffer("columns", self.table[:, 1])  # a strided view of another buffer
        self.register_buffer("bf16", torch.randn(100, 7).to(torch.bfloat16))


def test_values_identity_and_sharing_kept():
    torch.manual_seed(0)
    model = _Tied()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    strides = {name: tensor.stride() for name, tensor in model.state_dict().items()}
    parameters = list(model.parameters())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    assert len(storages) == 5  # the tied weight and the view share theirs
    moved = place_in_huge_pages(model)
    assert moved >= sum(storages.values()) > 2 << 20
    assert list(model.parameters()) == parameters  # the same Parameter objects
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == before[name].dtype and tensor.stride() == strides[name]
        assert torch.equal(tensor, before[name]), name
        assert "hg" in _mapping_flags(tensor.data_ptr()), name  # advised MADV_HUGEPAGE
    assert model.head.weight is model.embed.weight
    # a view still aliases its base: a write through one shows in the other
    assert model.columns.untyped_storage().data_ptr() == model.table.untyped_storage().data_ptr()
    model.table[5, 1] = -1.0
    assert model.columns[5] == -1.0
    # the first storage starts a huge page; each one a cache line (all share the mapping's storage
    # now: the tensors that are not views start their old storages)
    starts = sorted(t.data_ptr() for name, t in model.state_dict().items() if name != "columns")
    assert starts[0] % (2 << 20) == 0 and all(start % 64 == 0 for start in starts)
    x = torch.randn(3, 600)
    assert torch.equal(model.proj(x), torch.nn.functional.linear(x, before["proj.weight"], before["proj.bias"]))


def test_turned_off_or_too_small(monkeypatch):
    small = nn.Linear(8, 8)
    pointer = small.weight.data_ptr()
    assert place_in_huge_pages(small) == 0 and small.weight.data_ptr() == pointer  # under one huge page
    monkeypatch.setenv("PAGEDRS_WEIGHT_HUGE_PAGES", "0")
    model = _Tied()
    pointer = model.proj.weight.data_ptr()
    assert place_in_huge_pages(model) == 0 and model.proj.weight.data_ptr() == pointer


def test_engine_weights_in_huge_pages(monkeypatch):
    """The default model (packed GGUF blocks, int8 panels): its weights are placed at load, and
    decode the same tokens as an engine whose weights are not."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [list(range(1000, 1018))]
    placed = LLM(kv_cache_memory="64MiB", cpu_activation_quantization="int8")
    model = placed.engine.runner.model
    for name, tensor in model.state_dict().items():
        assert "hg" in _mapping_flags(tensor.data_ptr()), name
    outputs = placed.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    del placed, model
    monkeypatch.setenv("PAGEDRS_WEIGHT_HUGE_PAGES", "0")
    unplaced = LLM(kv_cache_memory="64MiB", cpu_activation_quantization="int8")
    reference = unplaced.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert outputs.token_ids == reference.token_ids
    assert [list(p.values())[0].logprob for p in outputs.logprobs] == [
        list(p.values())[0].logprob for p in reference.logprobs
    ]
