"""The fused-experts kernel (``torch.ops.pagedrs_cpu.fused_experts``, ``cpu/moe.cpp``) against a
per-expert torch loop (`pagedrs.layers.moe.experts_reference`, transformers' eager MoE) on the
dequantized weights, for float32 experts and every packed format, odd expert counts, experts
no token is routed to, top-k from 1 to 8, each activation; and bad inputs refused."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.layers.moe import ACTIVATION_IDS, Activation, experts_reference
from tests.helpers.k_quants import K_QUANTS
from tests.quant.test_quant_matmul import packed_weight

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build here")

F32 = 0
SILU = Activation("silu")
ACTIVATIONS = [SILU, Activation("gelu_pytorch_tanh"), Activation("gelu"), Activation("swiglu_oai", 1.702, 0.5)]


def routed(num_tokens: int, num_experts: int, top_k: int, seed: int, skip: int | None = None):
    """Random distinct experts per token (never ``skip``) and their softmax weights."""
    generator = torch.Generator().manual_seed(seed)
    allowed = [e for e in range(num_experts) if e != skip]
    scores = torch.rand(num_tokens, len(allowed), generator=generator)
    ids = torch.tensor(allowed)[scores.topk(top_k, dim=-1).indices]
    weights = torch.rand(num_tokens, top_k, generator=generator).softmax(-1)
    return ids.contiguous(), weights.contiguous()


def experts(qtype, num_experts: int, rows: int, cols: int, seed: int):
    """(the kernel's [E, rows, ...] weight, its dequantized float32 values [E, rows, cols])."""
    if qtype == F32:
        weight = torch.randn(num_experts, rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.2
        return weight, weight
    pairs = [packed_weight(qtype, rows, cols, seed + e) for e in range(num_experts)]
    return torch.stack([p for p, _ in pairs]), torch.stack([w for _, w in pairs])


def run(x, ids, weights, gate_up, gate_up_type, down, down_type, intermediate, activation=SILU, biases=(None, None)):
    return cpu_kernels.load().fused_experts(
        x,
        ids,
        weights,
        gate_up,
        int(gate_up_type),
        down,
        int(down_type),
        intermediate,
        ACTIVATION_IDS[activation.name],
        *biases,
        activation.alpha,
        activation.limit,
    )


CASES = [  # (num_tokens, num_experts, top_k, hidden, intermediate)
    (1, 4, 2, 64, 32),
    (1, 7, 1, 96, 64),
    (5, 9, 3, 64, 96),
    (17, 16, 8, 128, 64),
    (40, 5, 2, 64, 32),
]
Q_FORMATS = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


@pytest.mark.parametrize("qtype", [F32, *Q_FORMATS], ids=lambda t: "F32" if t == F32 else t.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}e{}k{}".format(*c[:3]))
def test_equals_a_loop_over_experts(qtype, case):
    num_tokens, num_experts, top_k, hidden, intermediate = case
    gate_up, gate_up_values = experts(qtype, num_experts, 2 * intermediate, hidden, seed=10)
    down, down_values = experts(qtype, num_experts, hidden, intermediate, seed=50)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = routed(num_tokens, num_experts, top_k, seed=num_tokens, skip=num_experts // 2)
    out = run(x, ids, weights, gate_up, qtype, down, qtype, intermediate)
    expected = experts_reference(x.double(), ids, weights.double(), gate_up_values.double(), down_values.double(), SILU)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_experts_and_mixed_types(qtype):
    """k-quant experts (256-weight superblocks), gate/up and down of different types (llama.cpp's
    Q4_K_M stores ffn_down_exps as Q6_K)."""
    num_tokens, num_experts, top_k, hidden, intermediate = 6, 5, 2, 256, 256
    gate_up, gate_up_values = experts(qtype, num_experts, 2 * intermediate, hidden, seed=1)
    down, down_values = experts(GGMLQuantizationType.Q8_0, num_experts, hidden, intermediate, seed=2)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(4))
    ids, weights = routed(num_tokens, num_experts, top_k, seed=7)
    out = run(x, ids, weights, gate_up, qtype, down, GGMLQuantizationType.Q8_0, intermediate)
    expected = experts_reference(x.double(), ids, weights.double(), gate_up_values.double(), down_values.double(), SILU)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("qtype", [F32, GGMLQuantizationType.Q8_0], ids=lambda t: "F32" if t == F32 else t.name)
def test_each_activation_with_and_without_biases(activation, qtype):
    """Every activation (gpt-oss's clamped SwiGLU with a limit small enough to clamp), with and
    without gpt-oss's per-expert biases."""
    gate_up, gate_up_values = experts(qtype, 3, 64, 64, seed=1)
    down, down_values = experts(qtype, 3, 64, 32, seed=2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    ids, weights = routed(4, 3, 2, seed=3)
    generator = torch.Generator().manual_seed(9)
    biases = (torch.randn(3, 64, generator=generator), torch.randn(3, 64, generator=generator))
    for bias in ((None, None), biases):
        out = run(x, ids, weights, gate_up, qtype, down, qtype, 32, activation, bias)
        expected = experts_reference(x, ids, weights, gate_up_values, down_values, activation, *bias)
        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_no_tokens_and_one_expert_for_every_token():
    gate_up, _ = experts(F32, 4, 64, 32, seed=1)
    down, _ = experts(F32, 4, 32, 32, seed=2)
    empty = run(torch.empty(0, 32), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), gate_up, F32, down, F32, 32)
    assert empty.shape == (0, 32)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    ids = torch.full((9, 1), 2, dtype=torch.long)
    out = run(x, ids, torch.ones(9, 1), gate_up, F32, down, F32, 32)
    assert torch.allclose(out, experts_reference(x, ids, torch.ones(9, 1), gate_up, down, SILU), atol=1e-5)


def test_bad_inputs_are_refused():
    gate_up, _ = experts(F32, 4, 64, 32, seed=1)
    down, _ = experts(F32, 4, 32, 32, seed=2)
    x = torch.randn(3, 32)
    ids, weights = routed(3, 4, 2, seed=1)
    with pytest.raises(RuntimeError, match="expert id 4 is outside"):
        run(x, torch.full((3, 2), 4, dtype=torch.long), weights, gate_up, F32, down, F32, 32)
    with pytest.raises(RuntimeError, match="topk_weights must be"):
        run(x, ids, weights[:, :1].contiguous(), gate_up, F32, down, F32, 32)
    with pytest.raises(RuntimeError, match="down must be"):
        run(x, ids, weights, gate_up, F32, down[:, :, :16].contiguous(), F32, 32)
    with pytest.raises(RuntimeError, match="gate_up \\(packed\\) must be uint8"):
        run(x, ids, weights, gate_up, GGMLQuantizationType.Q8_0, down, F32, 32)
