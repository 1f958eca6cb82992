"""The fused per-layer kernels (`pagedrs.layers.fused`) against the torch ops they replace,
through Triton's interpreter on the CPU (compiled on a GPU by make gpu-check's test stages),
and a model with them on against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedrs.kernels import triton as triton_runtime
from pagedrs.layers import fused
from pagedrs.layers.norm import RMSNorm

if not triton_runtime.available():
    pytest.skip("Triton is not installed here", allow_module_level=True)

pytestmark = pytest.mark.slow  # Triton's interpreter on the CPU; make gpu-check compiles them

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fused_on():
    fused.set_enabled(True)
    yield
    fused.set_enabled(None)


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    fused.set_enabled(False)
    try:
        return norm(x)
    finally:
        fused.set_enabled(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_add_rms_norm_matches_the_torch_ops(fused_on, dtype, hidden):
    generator = torch.Generator().manual_seed(hidden)
    x, delta = (torch.randn(7, hidden, generator=generator).to(DEVICE, dtype) for _ in range(2))
    norm = RMSNorm(hidden, 1e-5, dtype).to(DEVICE)
    norm.weight.data = torch.randn(hidden, generator=generator).to(DEVICE, dtype)
    residual, out = fused.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(residual, x + delta)
    torch.testing.assert_close(
        out, _torch_norm(norm, x + delta), rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-5
    )
    # Without a delta, through the module (any leading shape, e.g. Qwen3's per-head norms).
    heads = x.view(7, -1, hidden // 4 if hidden % 4 == 0 else hidden)
    small = RMSNorm(heads.shape[-1], 1e-6, dtype).to(DEVICE)
    torch.testing.assert_close(
        small(heads), _torch_norm(small, heads), rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("intermediate", [128, 1536, 3000])
def test_silu_and_mul_matches_the_torch_ops(fused_on, dtype, intermediate):
    gate_up = torch.randn(5, 2 * intermediate, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        fused.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-5
    )


def test_off_for_cpu_tensors_by_default():
    assert not fused.enabled(torch.zeros(1))
    fused.set_enabled(False)
    try:
        assert not fused.enabled(torch.zeros(1, device=DEVICE))
    finally:
        fused.set_enabled(None)


def test_model_with_fused_ops_matches_transformers(tiny_checkpoint, fused_on):
    """Every architecture (Qwen3's per-head norms included), float32: the same greedy tokens as
    Hugging Face generate, with every norm, residual add and activation through the kernels."""
    from pagedrs import LLM, SamplingParams

    _, directory, hf = tiny_checkpoint
    prompt = [5, 17, 33, 2, 9, 100, 42]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    llm = LLM(directory, device=DEVICE, dtype="float32", attention_backend="torch", kv_cache_memory="4MiB")
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "intermediate"),
    [(1, 4, 2, 64, 32), (7, 5, 3, 48, 40), (20, 16, 8, 64, 64), (33, 9, 1, 32, 16)],
)
def test_grouped_experts_match_the_loop_over_experts(num_tokens, num_experts, top_k, hidden, intermediate):
    """The Triton grouped matmuls of a mixture (odd expert counts, experts without tokens,
    sizes that are not whole tiles, top-k up to 8) against transformers' loop over experts."""
    from pagedrs.layers.moe import Activation, experts_reference

    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    scores = torch.rand(num_tokens, num_experts - 1, generator=generator)  # the last expert gets no token
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=generator).softmax(-1)
    x, gate_up, down, ids, weights = (t.to(DEVICE) for t in (x, gate_up, down, ids, weights))
    gpt_oss = Activation("swiglu_oai", 1.702, 0.5)
    biases = (gate_up[:, :, 0].contiguous(), down[:, :, 0].contiguous())  # [E, 2I], [E, H]
    for activation, bias in ((Activation("silu"), (None, None)), (gpt_oss, biases)):
        out = fused.grouped_experts(x, ids, weights, gate_up, down, activation, *bias)
        expected = experts_reference(x, ids, weights, gate_up, down, activation, *bias)
        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4)
