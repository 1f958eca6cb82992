"""The int8-activation matmul (``quant_matmul`` with ``INT8_ACTIVATIONS``) on whichever path this
build runs (AVX-512 VNNI, AVX-VNNI or AVX2's maddubs; ``PAGEDRS_CPU_ISA`` picks the build):

- each block's dot product is the exact integer one (VNNI; AVX2: exact sums of 4 products, added
  in float32), scaled by ``d_w * d_x`` in float32;
- a token's row does not depend on the batch it is in, bit for bit (one token, a tile of them,
  many tiles, a last panel of fewer rows);
- the kernels name the path they run, and it is the best one the build's instruction set has;
- on x86, a weight rearranged into stored panels (``pack_int8_panels``, ``INT8_PANELS``) holds
  the layout the kernel's header describes, sums each block exactly (with VNNI: the same floats
  as the row kernel, bit for bit); the panels are refused where they cannot be read."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.quant.layers import INT8_ACTIVATIONS, INT8_PANELS

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() or cpu_kernels.load().int8_activation_path() == "none",
    reason="the int8-activation path is not built here",
)

FORMATS = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
SHAPES = [  # (out_features, in_features): panels of 16 (or 8) rows, whole and short
    (1, 32),
    (7, 64),
    (16, 96),
    (17, 160),
    (97, 576),
    (40, 1536),
]


def _packed(qtype: GGMLQuantizationType, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    weight = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    return torch.from_numpy(quants.quantize(weight, qtype))


def _integer_reference(x: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType, products: int):
    """(sum over blocks of I * float32(d_w * d_x) (+ Q4_1's m * d_x * sum(q)) in float64, the sum
    of the terms' magnitudes), with I each block's exact integer dot product and x quantized as
    the kernel does in float32; the magnitudes count sums of ``products`` products, the integers
    the kernel converts to float."""
    num_tokens, in_features = x.shape
    num_blocks = in_features // 32
    blocks = x.view(num_tokens, num_blocks, 32)
    d_x = blocks.abs().amax(dim=-1) / 127
    inverse = torch.where(d_x != 0, 1 / d_x, torch.zeros_like(d_x))
    q_x = torch.round(blocks * inverse[..., None]).to(torch.int64)
    raw = packed.numpy().reshape(packed.shape[0], num_blocks, -1)
    d_w = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == GGMLQuantizationType.Q8_0:
        q_w = torch.from_numpy(raw[..., 2:].view(np.int8).astype(np.int64))
    else:
        nibbles = raw[..., 4:] if qtype == GGMLQuantizationType.Q4_1 else raw[..., 2:]
        q_w = torch.from_numpy(np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int64))
        if qtype == GGMLQuantizationType.Q4_0:
            q_w = q_w - 8
    groups = 32 // products
    sums = torch.einsum(
        "tbgk,nbgk->tnbg",
        q_x.view(num_tokens, num_blocks, groups, products),
        q_w.view(*q_w.shape[:2], groups, products),
    )
    terms = (sums.double() * (d_w[None] * d_x[:, None]).double()[..., None]).flatten(2)
    if qtype == GGMLQuantizationType.Q4_1:
        m_w = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        terms = torch.cat([terms, m_w[None] * (d_x * q_x.sum(dim=-1).float()).double()[:, None]], dim=-1)
    return terms.sum(dim=-1), terms.abs().sum(dim=-1)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_block_sums_are_exact_integers_scaled_in_float32(qtype, shape):
    out_features, in_features = shape
    packed = _packed(qtype, out_features, in_features, seed=out_features)
    x = torch.randn(19, in_features, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros
    out = cpu_kernels.load().quant_matmul(x, packed, int(qtype) | INT8_ACTIVATIONS, in_features)
    vnni = "vnni" in cpu_kernels.load().int8_activation_path()
    expected, magnitude = _integer_reference(x, packed, qtype, products=32 if vnni else 4)
    # float32 rounding of the scaled block sums and of their accumulation only
    bound = (in_features // 32 + 8) * torch.finfo(torch.float32).eps * magnitude
    assert bool(((out.double() - expected).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_tokens_row_does_not_depend_on_its_batch(qtype, shape):
    out_features, in_features = shape
    packed = _packed(qtype, out_features, in_features, seed=out_features + 1)
    x = torch.randn(67, in_features, generator=torch.Generator().manual_seed(2))
    kernel_type = int(qtype) | INT8_ACTIVATIONS
    ops = cpu_kernels.load()

    def matmul(rows: torch.Tensor) -> torch.Tensor:
        return ops.quant_matmul(rows.contiguous(), packed, kernel_type, in_features)

    full = matmul(x)
    for num_tokens in (1, 3, 8, 9, 17):
        assert torch.equal(matmul(x[:num_tokens]), full[:num_tokens])
    for token in (7, 8, 33, 66):
        assert torch.equal(matmul(x[token : token + 1])[0], full[token])


def _cpuinfo(field: str) -> list[str]:
    """Each of /proc/cpuinfo's lines for ``field``, its value (none where there is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith(field)]


def _cpu_flags() -> set[str]:
    return {flag for value in _cpuinfo("flags") for flag in value.split()}


def test_the_kernels_name_the_best_int8_path_of_their_instruction_set():
    path = cpu_kernels.load().int8_activation_path()
    isa = os.environ.get("PAGEDRS_CPU_ISA", "native")
    if isa == "native":
        flags = _cpu_flags()
        if not flags:
            pytest.skip("no /proc/cpuinfo to read this CPU's instruction sets from")
        if "avx512_vnni" in flags and "avx512bw" in flags:
            expected = "avx512-vnni"
        elif "avx_vnni" in flags:
            expected = "avx-vnni"
        else:
            expected = "avx2"
    else:
        expected = {"avx2": "avx2", "avxvnni": "avx-vnni", "avx512": "avx2"}[isa]
    assert path == expected
    assert cpu_kernels.INT8_PATHS[path] in cpu_kernels.describe()


def test_stored_panels_are_prefetched_in_software_where_that_measured_faster():
    """Where the CPU's own prefetchers keep up with the panels' stream, software prefetches
    measured slower (AMD Zen 4; none on AMD CPUs not measured either); on AMD Zen 3 2 KB ahead
    measured fastest, elsewhere 8 KB (quant_matmul.cpp's kStoredPrefetchAhead). The start-up log
    says which."""
    prefetch = int(cpu_kernels.load().int8_panel_prefetch_bytes())
    if _panel_rows() == 0:
        assert prefetch == -1  # no stored panels in this build
        return
    vendors, families, models = set(_cpuinfo("vendor_id")), set(_cpuinfo("cpu family")), set(_cpuinfo("model\t"))
    if not vendors or len(families) != 1 or len(models) != 1:
        pytest.skip("no single CPU model in /proc/cpuinfo to read")
    family, model = int(families.pop()), int(models.pop())
    zen3 = family == 0x19 and (model < 0x10 or 0x20 <= model < 0x30 or 0x40 <= model < 0x60)
    assert prefetch == (8192 if vendors != {"AuthenticAMD"} else 2048 if zen3 else 0)
    assert (
        "read behind the CPU's own prefetchers" if prefetch == 0 else f"prefetched {prefetch // 1024} KB ahead"
    ) in cpu_kernels.describe()


def _panel_rows() -> int:
    return int(cpu_kernels.load().int8_panel_rows())


def _reference_panels(packed: torch.Tensor, qtype: GGMLQuantizationType, rows: int, vnni: bool) -> np.ndarray:
    """The stored panel layout, from the kernel's header: per panel of ``rows`` rows and block,
    the quants' 4-byte words k of every row (word-major; with VNNI Q8_0's bytes + 128), then the
    rows' fp16 d, then (Q4_1) their fp16 m."""
    block_bytes = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}[qtype]
    num_panels = packed.shape[0] // rows
    raw = packed.numpy().reshape(num_panels, rows, -1, block_bytes)  # [panel, row, block, byte]
    quants_at = block_bytes - (32 if qtype == GGMLQuantizationType.Q8_0 else 16)
    quants = raw[..., quants_at:].reshape(num_panels, rows, raw.shape[2], -1, 4)  # [.., word, byte]
    if qtype == GGMLQuantizationType.Q8_0 and vnni:
        quants = quants ^ 0x80
    parts = [quants.transpose(0, 2, 3, 1, 4), raw[..., 0:2].transpose(0, 2, 1, 3)]
    if qtype == GGMLQuantizationType.Q4_1:
        parts.append(raw[..., 2:4].transpose(0, 2, 1, 3))
    blocks = [part.reshape(num_panels, raw.shape[2], -1) for part in parts]
    return np.concatenate(blocks, axis=-1).reshape(packed.shape)


needs_panels = pytest.mark.skipif(
    not cpu_kernels.available() or cpu_kernels.load().int8_panel_rows() == 0,
    reason="stored int8 panels are an x86 build's",
)


@needs_panels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("panels", [1, 3, 6])
@pytest.mark.parametrize("in_features", [32, 96, 576])
def test_stored_panels_hold_the_layout_and_sum_each_block_exactly(qtype, panels, in_features):
    rows = _panel_rows()
    packed = _packed(qtype, panels * rows, in_features, seed=panels * 7 + in_features)
    ops = cpu_kernels.load()
    stored = ops.pack_int8_panels(packed, int(qtype), in_features)
    assert stored.shape == packed.shape and stored.dtype == torch.uint8
    vnni = "vnni" in ops.int8_activation_path()
    assert np.array_equal(stored.numpy(), _reference_panels(packed, qtype, rows, vnni))
    x = torch.randn(67, in_features, generator=torch.Generator().manual_seed(3)) * 2
    x[1, :32] = 0.0
    full = ops.quant_matmul(x, stored, int(qtype) | INT8_ACTIVATIONS | INT8_PANELS, in_features)
    # Each block's integer sum exact, scaled in float32 (VNNI's row kernel does the same).
    expected, magnitude = _integer_reference(x, packed, qtype, products=32)
    bound = (in_features // 32 + 8) * torch.finfo(torch.float32).eps * magnitude
    assert bool(((full.double() - expected).abs() <= bound + 1e-30).all())
    for num_tokens in (1, 2, 7, 8, 9, 17):  # a row does not depend on its batch
        panel_out = ops.quant_matmul(x[:num_tokens], stored, int(qtype) | INT8_ACTIVATIONS | INT8_PANELS, in_features)
        assert torch.equal(panel_out, full[:num_tokens])
        if vnni:  # the same floats as the row kernel's
            rows_out = ops.quant_matmul(x[:num_tokens], packed, int(qtype) | INT8_ACTIVATIONS, in_features)
            assert torch.equal(panel_out, rows_out)


@needs_panels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_an_embedding_lookup_reads_the_rows_back_out_of_stored_panels(qtype):
    ops = cpu_kernels.load()
    packed = _packed(qtype, 3 * _panel_rows(), 96, seed=5)
    stored = ops.pack_int8_panels(packed, int(qtype), 96)
    ids = torch.tensor([0, 1, 5, 17, 3 * _panel_rows() - 1, 5])
    expected = ops.embedding_rows(packed, ids, int(qtype), 96)
    assert torch.equal(ops.embedding_rows(stored, ids, int(qtype) | INT8_PANELS, 96), expected)
    assert torch.equal(expected, torch.from_numpy(quants.dequantize(packed.numpy(), qtype))[ids])


@needs_panels
def test_stored_panels_are_refused_where_they_cannot_be_read():
    rows = _panel_rows()
    ops = cpu_kernels.load()
    q4_1 = GGMLQuantizationType.Q4_1
    short = _packed(q4_1, rows + 1, 64, seed=1)
    with pytest.raises(RuntimeError, match="whole panels"):
        ops.pack_int8_panels(short, int(q4_1), 64)
    with pytest.raises(RuntimeError, match="Q8_0 .8., Q4_0 .2. or Q4_1 .3."):
        ops.pack_int8_panels(torch.zeros(rows, 144, dtype=torch.uint8), int(GGMLQuantizationType.Q4_K), 256)
    with pytest.raises(RuntimeError, match="must be contiguous uint8"):
        ops.pack_int8_panels(_packed(q4_1, rows, 64, seed=2), int(q4_1), 96)
    stored = ops.pack_int8_panels(_packed(q4_1, rows, 64, seed=3), int(q4_1), 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="need int8 activations"):  # the exact path reads GGUF rows
        ops.quant_matmul(x, stored, int(q4_1) | INT8_PANELS, 64)
    with pytest.raises(RuntimeError, match="whole panels"):
        ops.embedding_rows(torch.zeros(rows + 1, 40, dtype=torch.uint8), torch.tensor([0]), int(q4_1) | INT8_PANELS, 64)
    short_stored = torch.zeros(rows + 1, 40, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="whole panels"):
        ops.quant_matmul(x, short_stored, int(q4_1) | INT8_ACTIVATIONS | INT8_PANELS, 64)


def test_the_panels_have_the_rows_of_their_registers():
    """16 rows with AVX-512 VNNI, 8 with AVX-VNNI and AVX2 (32-bit lanes of 512- and 256-bit
    registers); NEON builds have none and refuse to pack."""
    ops = cpu_kernels.load()
    rows = {"avx512-vnni": 16, "avx-vnni": 8, "avx2": 8}.get(ops.int8_activation_path(), 0)
    assert ops.int8_panel_rows() == rows
    if rows == 0:
        with pytest.raises(RuntimeError, match="has no stored int8 panels"):
            ops.pack_int8_panels(_packed(GGMLQuantizationType.Q8_0, 16, 32, seed=1), 8, 32)
