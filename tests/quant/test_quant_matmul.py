"""The weight-only quantized matmul (``torch.ops.pagedrs_cpu.quant_matmul``) equals "dequantize
with ``gguf.quants``, then ``F.linear``" up to the order of the additions, for every format
(the k-quants Q4_K and Q6_K on random blocks: gguf.quants cannot make them),
odd token counts, output counts that are not a multiple of any tile, and float32, bfloat16 or
float16 activations; the torch dequantizer and Q8_0 quantizer equal ``gguf.quants`` bit for bit.
On AVX2 builds the same holds for rows in the scales-first order (``pack_scales_first``,
``SCALES_FIRST``), whose lookups give the GGUF rows' values bit for bit; elsewhere they are
refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from pagedrs.checkpoint import ggml_blocks
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.quant.layers import INT8_ACTIVATIONS, SCALES_FIRST
from tests.helpers.k_quants import K_QUANTS, random_k_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build here")

FORMATS = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
SHAPES = [  # (num_tokens, out_features, in_features)
    (1, 1, 32),
    (1, 97, 64),
    (3, 130, 96),
    (8, 64, 160),
    (13, 71, 576),
    (33, 200, 64),
    # Over 4 tokens, rows longer than 768 features are walked in segments on the AVX2 path
    # (matmul_rows): two of 24 blocks; then 24, 24 and 2, with a last tile of one token.
    (13, 40, 1536),
    (9, 30, 1600),
    # From 128 tokens on, panels of weight rows (8 MiB of float32, at least 256 rows) are
    # dequantized and multiplied by torch's sgemm:
    (128, 200, 96),  # one panel, straight into the output
    (130, 600, 8192),  # three panels of 256 rows, the last one partial
]


K_SHAPES = [
    (1, 1, 256),
    (1, 97, 512),
    (3, 130, 768),
    (13, 71, 256),
    (33, 20, 512),
    (13, 40, 2304),  # three segments of 3 superblocks (AVX2, over 4 tokens)
    (140, 300, 256),
    (129, 300, 8192),
]


def packed_weight(qtype, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed rows, their dequantized float32 values by gguf.quants)."""
    if qtype in K_QUANTS:
        packed = random_k_blocks(qtype, out_features, in_features, seed)
        return torch.from_numpy(packed), torch.from_numpy(quants.dequantize(packed, qtype))
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).numpy()
    packed = quants.quantize(weight, qtype)
    return torch.from_numpy(packed), torch.from_numpy(quants.dequantize(packed, qtype))


@pytest.mark.parametrize(
    ("qtype", "shape"),
    [(qtype, shape) for qtype in FORMATS for shape in SHAPES]
    + [(qtype, shape) for qtype in K_QUANTS for shape in K_SHAPES],
    ids=lambda value: value.name if isinstance(value, GGMLQuantizationType) else "x".join(map(str, value)),
)
def test_matches_dequantize_then_linear_in_float32(qtype, shape):
    num_tokens, out_features, in_features = shape
    packed, weight = packed_weight(qtype, out_features, in_features, seed=num_tokens * 1000 + out_features)
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(1))
    out = cpu_kernels.load().quant_matmul(x, packed, int(qtype), in_features)
    assert_dequantize_then_linear(out, x, weight)


def assert_dequantize_then_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    expected = F.linear(x.double(), weight.double())
    assert out.dtype == torch.float32 and out.shape == expected.shape
    # Float32 sums of in_features products in another order: errors of a few ulps of the
    # sum of |terms|.
    bound = 8 * x.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    assert ((out.double() - expected).abs() <= bound + 1e-30).all()


needs_scales_first = pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.load().scales_first_rows(),
    reason="this build reads no scales-first rows (AVX2 builds only)",
)
SCALES_FIRST_SHAPES = SHAPES + [
    # One token takes rows two at a time (an odd last row alone); up to 4 tokens a row's
    # scales are converted 64 blocks at a time: 4096 features are two pieces, 2080 a piece of
    # 64 blocks and one of 1.
    (1, 2, 32),
    (1, 9, 4096),
    (1, 5, 2080),
    (4, 6, 2080),
]


@needs_scales_first
@pytest.mark.parametrize(
    ("qtype", "shape"),
    [(qtype, shape) for qtype in FORMATS for shape in SCALES_FIRST_SHAPES],
    ids=lambda value: value.name if isinstance(value, GGMLQuantizationType) else "x".join(map(str, value)),
)
def test_scales_first_rows_match_dequantize_then_linear(qtype, shape):
    num_tokens, out_features, in_features = shape
    packed, weight = packed_weight(qtype, out_features, in_features, seed=num_tokens * 1000 + out_features)
    ops = cpu_kernels.load()
    stored = ops.pack_scales_first(packed, int(qtype), in_features)
    assert stored.shape == packed.shape and stored.dtype == torch.uint8
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(1))
    assert_dequantize_then_linear(ops.quant_matmul(x, stored, int(qtype) | SCALES_FIRST, in_features), x, weight)


@needs_scales_first
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_scales_first_rows_hold_the_layout_and_look_up_as_gguf_rows(qtype):
    packed, weight = packed_weight(qtype, 5, 96, seed=4)
    stored = cpu_kernels.load().pack_scales_first(packed, int(qtype), 96)
    # Each row: its 3 blocks' fp16 d, then (Q4_1) their fp16 m, then their quants in order.
    blocks = packed.view(5, 3, -1)
    halves = 2 if qtype == GGMLQuantizationType.Q4_1 else 1
    expected = torch.cat(
        [blocks[:, :, 2 * h : 2 * h + 2].reshape(5, -1) for h in range(halves)]
        + [blocks[:, :, 2 * halves :].reshape(5, -1)],
        dim=1,
    )
    assert torch.equal(stored, expected)
    ids = torch.tensor([4, 0, 2, 4])
    assert torch.equal(cpu_kernels.load().embedding_rows(stored, ids, int(qtype) | SCALES_FIRST, 96), weight[ids])


def test_scales_first_rows_are_refused_where_they_cannot_be_read():
    ops = cpu_kernels.load()
    q4_1 = GGMLQuantizationType.Q4_1
    packed, _ = packed_weight(q4_1, 8, 64, seed=2)
    x = torch.randn(2, 64)
    if not ops.scales_first_rows():
        with pytest.raises(RuntimeError, match="no scales-first rows"):
            ops.pack_scales_first(packed, int(q4_1), 64)
        with pytest.raises(RuntimeError, match="no scales-first rows"):
            ops.quant_matmul(x, packed, int(q4_1) | SCALES_FIRST, 64)
        return
    with pytest.raises(RuntimeError, match="Q8_0 .8., Q4_0 .2. or Q4_1 .3."):
        ops.pack_scales_first(torch.zeros(2, 144, dtype=torch.uint8), int(GGMLQuantizationType.Q4_K), 256)
    with pytest.raises(RuntimeError, match="must be contiguous uint8"):
        ops.pack_scales_first(packed, int(q4_1), 96)
    stored = ops.pack_scales_first(packed, int(q4_1), 64)
    with pytest.raises(RuntimeError, match="for exact activations"):  # int8's own layout is the panels
        ops.quant_matmul(x, stored, int(q4_1) | SCALES_FIRST | INT8_ACTIVATIONS, 64)
    k_blocks, _ = packed_weight(GGMLQuantizationType.Q4_K, 2, 256, seed=3)
    with pytest.raises(RuntimeError, match="hold Q8_0, Q4_0 or Q4_1"):
        ops.quant_matmul(torch.randn(1, 256), k_blocks, int(GGMLQuantizationType.Q4_K) | SCALES_FIRST, 256)


@pytest.mark.parametrize("qtype", FORMATS + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_activations_give_their_dtype_out_rounded_once(qtype, dtype):
    packed, weight = packed_weight(qtype, 45, 256, seed=3)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = cpu_kernels.load().quant_matmul(x, packed, int(qtype), 256)
    assert out.dtype == dtype
    expected = F.linear(x.double(), weight.double())
    # One rounding to the 16-bit dtype (half its epsilon: 2**-8 for bfloat16, 2**-11 for
    # float16) of a float32 sum.
    assert torch.allclose(
        out.double(), expected, rtol=torch.finfo(dtype).eps / 2, atol=1e-4 * expected.abs().max().item()
    )


def test_packed_layer_with_float16_input_matches_the_dequantized_weights():
    """The packed path of ``LLM(dtype="float16", device="cpu")``: a layer's float16 output is
    its dequantized weights' float64 product, rounded once to float16."""
    from pagedrs.layers.linear import RowParallelLinear, TensorParallel
    from pagedrs.quant.layers import QuantRowParallelLinear

    packed, weight = packed_weight(GGMLQuantizationType.Q4_1, 24, 96, seed=5)
    dense = RowParallelLinear(96, 24, bias=False, tp=TensorParallel(0, 1), dtype=torch.float16)
    layer = QuantRowParallelLinear(dense, GGMLQuantizationType.Q4_1)
    layer.weight.copy_(packed)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(6)).half()
    out = layer(x)
    assert out.dtype == torch.float16 and out.shape == (2, 3, 24)
    expected = F.linear(x.double(), weight.double())
    assert torch.allclose(out.double(), expected, rtol=2**-11, atol=1e-4 * expected.abs().max().item())


def test_empty_batch_gives_empty_output():
    packed, _ = packed_weight(GGMLQuantizationType.Q8_0, 16, 64, seed=0)
    out = cpu_kernels.load().quant_matmul(torch.empty(0, 64), packed, int(GGMLQuantizationType.Q8_0), 64)
    assert out.shape == (0, 16)


def test_bad_inputs_are_refused():
    op = cpu_kernels.load().quant_matmul
    q8 = int(GGMLQuantizationType.Q8_0)
    packed, _ = packed_weight(GGMLQuantizationType.Q8_0, 16, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="ggml types"):
        op(x, packed, int(GGMLQuantizationType.Q5_K), 64)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        op(x, packed, int(GGMLQuantizationType.Q6_K), 64)  # k-quants take whole 256-weight blocks
    with pytest.raises(RuntimeError, match="weight must be"):
        op(x, packed, int(GGMLQuantizationType.Q4_0), 64)  # Q8_0 rows read as Q4_0: wrong width
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 48), packed, q8, 48)
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.randn(2, 96), packed, q8, 64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        op(x.double(), packed, q8, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        op(x, packed.to(torch.int8), q8, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(64, 2).T, packed, q8, 64)


@pytest.mark.parametrize("qtype", FORMATS + K_QUANTS, ids=lambda t: t.name)
def test_torch_dequantize_equals_gguf(qtype):
    packed, weight = packed_weight(qtype, 7, 256, seed=9)
    assert torch.equal(ggml_blocks.dequantize(packed, qtype), weight)


@pytest.mark.parametrize("qtype", FORMATS + K_QUANTS, ids=lambda t: t.name)
def test_embedding_rows_are_gguf_dequantized_rows(qtype):
    packed, weight = packed_weight(qtype, 50, 512, seed=11)
    ids = torch.tensor([7, 0, 49, 7, 3])  # a repeat, the first and the last row
    rows = cpu_kernels.load().embedding_rows(packed, ids, int(qtype), 512)
    assert torch.equal(rows, weight[ids])
    assert cpu_kernels.load().embedding_rows(packed, ids[:0], int(qtype), 512).shape == (0, 512)


def test_embedding_rows_refuse_ids_outside_the_table():
    packed, _ = packed_weight(GGMLQuantizationType.Q8_0, 4, 64, seed=1)
    for bad in (4, -1):
        with pytest.raises(RuntimeError, match="not a row"):
            cpu_kernels.load().embedding_rows(packed, torch.tensor([0, bad]), int(GGMLQuantizationType.Q8_0), 64)


def test_q8_0_quantizer_equals_gguf_bit_for_bit():
    weight = torch.randn(9, 128, generator=torch.Generator().manual_seed(4))
    weight[0, :32] = 0  # an all-zero block (scale 0)
    weight[1, 5] = 2.5 * weight[1, :32].abs().max() / 127  # about halfway between steps 2 and 3
    expected = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    assert torch.equal(ggml_blocks.quantize_q8_0(weight), torch.from_numpy(expected))


def _has_avx2() -> bool:
    """Whether the kernels (built for this machine) have the int8-activation path."""
    return cpu_kernels.native_isa() in ("avx2", "avx512")


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: each 32 features rounded to multiples of max|x| / 127."""
    blocks = x.double().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale == 0, 1, scale)) * scale).view_as(x.double())


@pytest.mark.skipif(not _has_avx2(), reason="int8 activations run on AVX2")
@pytest.mark.parametrize(
    ("qtype", "shape"),
    [(qtype, shape) for qtype in FORMATS for shape in SHAPES],
    ids=lambda value: value.name if isinstance(value, GGMLQuantizationType) else "x".join(map(str, value)),
)
def test_int8_activations_equal_quantized_rows_times_the_weights(qtype, shape):
    """The integer path equals "quantize each token's 32-feature blocks to int8, then the float
    matmul" up to float rounding, and differs from the exact path by no more than x's rounding."""
    num_tokens, out_features, in_features = shape
    packed, weight = packed_weight(qtype, out_features, in_features, seed=num_tokens * 1000 + out_features)
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(1)) * 3
    if in_features > 32:
        x[0, :32] = 0.0  # an all-zero block quantizes to zeros
    ops = cpu_kernels.load()
    out = ops.quant_matmul(x, packed, int(qtype) | INT8_ACTIVATIONS, in_features)
    exact = ops.quant_matmul(x, packed, int(qtype), in_features)
    expected = F.linear(_int8_rows(x), weight.double())
    bound = 8 * in_features * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    assert bool(((out.double() - expected).abs() <= bound + 1e-5).all())
    # Apart from the exact path by at most the rounding of x: sum |w| * |x - q(x)|.
    rounding = (x.double() - _int8_rows(x)).abs() @ weight.abs().double().T
    assert bool(((out.double() - exact.double()).abs() <= rounding + 2 * bound + 1e-5).all())


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_int8_activations_leave_the_k_quants_exact(qtype):
    packed, _ = packed_weight(qtype, 20, 256, seed=3)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    ops = cpu_kernels.load()
    exact = ops.quant_matmul(x, packed, int(qtype), 256)
    assert torch.equal(ops.quant_matmul(x, packed, int(qtype) | INT8_ACTIVATIONS, 256), exact)
