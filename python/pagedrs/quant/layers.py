"""Linears and the vocabulary embedding holding packed GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) for this
rank's shard, multiplied by ``torch.ops.pagedrs_cpu.quant_matmul`` without a float copy.

Each is built from the dense layer the model code made (`pagedrs.layers.linear`), takes over its
shard geometry (which rows or columns of the full checkpoint tensor this rank holds) and its
bias, and loads either a GGUF tensor's packed rows as stored (``handle.packed_rows``) or a float
tensor it quantizes to Q8_0 (``--quantization int8``).

Sharding: a column-parallel shard is a row range of the packed weight (rows are output
features, whole rows move); a row-parallel shard is a column range, a whole number of
blocks of every row (32 weights, 256 for the k-quants; `fits_row_shard` says whether a layer's
shard is).
"""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedrs.checkpoint import ggml_blocks
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabEmbedding,
    gather_logits,
)
from pagedrs.layers.moe import FusedExperts
from pagedrs.quant.sharding import ColumnShardBias, ReplicatedBias

INT8_ACTIVATIONS = 1 << 8
"""A kernel type id ORed with it quantizes the activations to int8 (``cpu/cpu_kernels.h``'s
``kInt8Activations``)."""
INT8_PANELS = 1 << 9
"""ORed with `INT8_ACTIVATIONS`: the weight's bytes are in the kernel's stored int8 panels
(``pack_int8_panels``, ``cpu/cpu_kernels.h``'s ``kInt8Panels``)."""
INT8_ACTIVATION_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})
"""The formats the kernel multiplies by int8 activations (the others stay exact)."""
SCALES_FIRST = 1 << 10
"""Exact activations only: each row's bytes are in the kernel's scales-first order
(``pack_scales_first``, ``cpu/cpu_kernels.h``'s ``kScalesFirst``; the formats of
`INT8_ACTIVATION_TYPES`, AVX2 builds)."""


def quant_matmul(x: torch.Tensor, packed: torch.Tensor, kernel_type: int) -> torch.Tensor:
    """``x @ dequant(packed)^T`` over x's last dimension, in x's dtype; ``kernel_type``: the
    ggml type, possibly with `INT8_ACTIVATIONS`."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features).contiguous()
    out = cpu_kernels.load().quant_matmul(flat, packed, int(kernel_type), in_features)
    return out.reshape(*x.shape[:-1], packed.shape[0])


def _packed_slice(weight: Any, ggml_type: GGMLQuantizationType, rows: slice, cols: slice) -> torch.Tensor:
    """The packed blocks of ``weight[rows, cols]`` (one of them ``slice(None)``): a GGUF tensor
    of this type gives its stored blocks; anything else (a float tensor or handle) is read and
    quantized to Q8_0."""
    if getattr(weight, "ggml_type", None) == ggml_type and hasattr(weight, "packed_rows"):
        return weight.packed_rows(rows) if cols == slice(None) else weight.packed_cols(cols)
    if ggml_type != GGMLQuantizationType.Q8_0:
        raise ValueError(f"a float weight is quantized to Q8_0 only, not {ggml_type.name}")
    return ggml_blocks.quantize_q8_0(weight[rows, cols] if cols != slice(None) else weight[rows])


class _Packed(nn.Module):
    """Holds ``weight``: uint8 ``[rows, in_features / block_weights * block_bytes]``, the packed blocks.

    NOTE: a parameter named ``weight`` like the dense layer's, so the model's loader still
    finds a checkpoint tensor missing, and parameter byte counts are the packed bytes."""

    def __init__(self, rows: int, in_features: int, ggml_type: GGMLQuantizationType):
        super().__init__()
        self.ggml_type = GGMLQuantizationType(ggml_type)
        self.in_features = in_features
        self.int8_activations = False
        """Multiply by int8-quantized activations (`use_int8_activations`); exact otherwise."""
        self.int8_panels = False
        """``weight`` holds the kernel's stored int8 panels, not the GGUF rows (`use_int8_activations`)."""
        self.scales_first = False
        """``weight``'s rows are in the kernel's scales-first order, not GGUF's (`use_scales_first`)."""
        packed = torch.empty(rows, ggml_blocks.row_bytes(ggml_type, in_features), dtype=torch.uint8)
        self.weight = nn.Parameter(packed, requires_grad=False)

    @property
    def kernel_type(self) -> int:
        """The CPU kernels' id of how to multiply by this weight."""
        return self.table_type | (INT8_ACTIVATIONS if self.int8_activations else 0)

    @property
    def table_type(self) -> int:
        """The kernels' type id of the rows as stored, for a lookup (``embedding_rows``)."""
        layout = (INT8_PANELS if self.int8_panels else 0) | (SCALES_FIRST if self.scales_first else 0)
        return int(self.ggml_type) | layout

    def extra_repr(self) -> str:
        activations = ", int8 activations" if self.int8_activations else ""
        activations += " (stored panels)" if self.int8_panels else ""
        activations += ", scales-first rows" if self.scales_first else ""
        return f"{self.ggml_type.name}, out={self.weight.shape[0]}, in={self.in_features}{activations}"


def use_int8_activations(model: nn.Module) -> int:
    """Switches every packed linear (and the packed head) whose format has the integer path
    to int8 activations; returns how many. Where this build has stored panels (x86: AVX2,
    AVX-VNNI, AVX-512 VNNI), the weights are rearranged into them (the same bytes, in the order
    the integer kernel reads them: one stream, no regrouping per call; a packed embedding's
    lookups read its rows back out of them), except where the rows are not whole panels."""
    panel_rows = cpu_kernels.load().int8_panel_rows()
    switched = 0
    for module in model.modules():
        if isinstance(module, _Packed) and module.ggml_type in INT8_ACTIVATION_TYPES:
            module.int8_activations = True
            switched += 1
            rows = module.weight.shape[0]
            if panel_rows and rows % panel_rows == 0:
                packed = cpu_kernels.load().pack_int8_panels(module.weight, int(module.ggml_type), module.in_features)
                module.weight = nn.Parameter(packed, requires_grad=False)
                module.int8_panels = True
    return switched


def use_scales_first(model: nn.Module) -> int:
    """Puts the rows of every packed linear (and the packed head and embedding) of a format
    that has them into the kernel's scales-first order, for the exact path, where this build
    reads it (AVX2 without AVX-512); returns how many.

    - The same bytes and values: results as from GGUF's rows up to the order of additions.
    - Why: there the exact kernel is bound by its instructions, and a GGUF block's scales cost
      4-5 of a Q4_1 block's ~22; on a Zen 3 CPU a single token's matmul took 0.81-0.92x the time.
    """
    if not cpu_kernels.load().scales_first_rows():
        return 0
    switched = 0
    for module in model.modules():
        if (
            isinstance(module, _Packed)
            and module.ggml_type in INT8_ACTIVATION_TYPES
            and not module.int8_activations
            and not module.scales_first
        ):
            packed = cpu_kernels.load().pack_scales_first(module.weight, int(module.ggml_type), module.in_features)
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.scales_first = True
            switched += 1
    return switched


class QuantColumnParallelLinear(ColumnShardBias, _Packed):
    """`ColumnParallelLinear` with packed rows: this rank's rows of each fused logical output."""

    def __init__(self, dense: ColumnParallelLinear, ggml_type: GGMLQuantizationType):
        super().__init__(dense.weight.shape[0], dense.weight.shape[1], ggml_type)
        # The dense layer's own rule for which rows this rank holds, per logical output.
        self.shard_rows = [dense._rows(shard) for shard in range(len(dense.output_sizes))]
        self.bias = dense.bias

    def load(self, shard: int, weight: Any) -> None:
        source, target = self.shard_rows[shard]
        self.weight[target].copy_(_packed_slice(weight, self.ggml_type, source, slice(None)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quant_matmul(x, self.weight, self.kernel_type)
        return out + self.bias if self.bias is not None else out


def fits_row_shard(dense: RowParallelLinear, ggml_type: GGMLQuantizationType) -> bool:
    """Whether a row-parallel layer's shard (a column range) is whole blocks of ``ggml_type``."""
    return ggml_blocks.fits_blocks(ggml_type, dense.input_size)


class QuantRowParallelLinear(ReplicatedBias, _Packed):
    """`RowParallelLinear` with packed blocks of this rank's input columns; partial sums are
    all-reduced across ranks, the bias added once after."""

    def __init__(self, dense: RowParallelLinear, ggml_type: GGMLQuantizationType):
        if not fits_row_shard(dense, ggml_type):
            block = ggml_blocks.block_weights(ggml_type)
            raise ValueError(f"a shard of {dense.input_size} input features is not whole {block}-blocks")
        super().__init__(dense.weight.shape[0], dense.input_size, ggml_type)
        self.tp: TensorParallel = dense.tp
        self.input_cols = dense.input_cols()  # the dense layer's rule for this rank's columns
        self.bias = dense.bias

    def load(self, weight: Any) -> None:
        self.weight.copy_(_packed_slice(weight, self.ggml_type, slice(None), self.input_cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quant_matmul(x, self.weight, self.kernel_type)
        if self.tp.size > 1:
            torch.distributed.all_reduce(out)
        return out + self.bias if self.bias is not None else out


class QuantVocabEmbedding(_Packed):
    """`VocabEmbedding` with packed rows: a lookup dequantizes just the looked-up rows; the tied
    (or separate) head multiplies by the packed rows (the biggest matmul of a small model)."""

    def __init__(self, dense: VocabEmbedding, ggml_type: GGMLQuantizationType):
        super().__init__(dense.shard_size, dense.weight.shape[1], ggml_type)
        self.tp: TensorParallel = dense.tp
        self.shard_size, self.start = dense.shard_size, dense.start
        # As the dense layer: a vocabulary that does not split evenly pads the last rank with
        # zero rows (all-zero blocks dequantize to 0), cut off the gathered logits.
        self.vocab_size, self.num_rows = dense.vocab_size, dense.num_rows
        self.weight.zero_()
        self.dtype = dense.weight.dtype

    def load(self, weight: Any) -> None:
        rows = slice(self.start, self.start + self.num_rows)
        self.weight[: self.num_rows].copy_(_packed_slice(weight, self.ggml_type, rows, slice(None)))

    def _lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        # NOTE: no op where none is needed (a step's ids are already flat int64, the model
        # float32): each costs ~5 us, cold, in a single-stream decode step.
        flat = token_ids
        if flat.dim() != 1 or flat.dtype != torch.int64 or not flat.is_contiguous():
            flat = token_ids.reshape(-1).to(torch.int64).contiguous()
        rows = cpu_kernels.load().embedding_rows(self.weight, flat, self.table_type, self.in_features)
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        return rows if token_ids.dim() == 1 else rows.reshape(*token_ids.shape, self.in_features)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(token_ids)
        local = token_ids - self.start
        inside = (local >= 0) & (local < self.shard_size)
        out = self._lookup(local.clamp(0, self.shard_size - 1)) * inside.unsqueeze(-1)
        torch.distributed.all_reduce(out)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As `VocabEmbedding.logits`: the whole vocabulary on rank 0 (gathered), this rank's
        slice elsewhere."""
        return gather_logits(quant_matmul(hidden, self.weight, self.kernel_type), self.tp, self.vocab_size)


class QuantFusedExperts(FusedExperts):
    """`FusedExperts` with packed blocks: ``gate_up`` uint8 ``[E, 2 * I / tp, H / block_weights *
    block_bytes]`` and ``down`` uint8 ``[E, H, I / tp / block_weights * block_bytes]``, each of its
    own type, loaded as a GGUF file stores them (``ffn_*_exps``: packed rows of each expert) or
    quantized to Q8_0 from float weights; run by the CPU kernel (in float32)."""

    def __init__(self, dense: FusedExperts, gate_up_type: GGMLQuantizationType, down_type: GGMLQuantizationType):
        nn.Module.__init__(self)
        self.num_experts, self.hidden_size = dense.num_experts, dense.hidden_size
        self.intermediate_size, self.tp = dense.intermediate_size, dense.tp
        self.activation, self._loaded = dense.activation, set()
        self.gate_up_bias, self.down_bias = dense.gate_up_bias, dense.down_bias
        self.gate_up_type, self.down_type = int(gate_up_type), int(down_type)
        gate_up_bytes = ggml_blocks.row_bytes(gate_up_type, self.hidden_size)
        down_bytes = ggml_blocks.row_bytes(down_type, self.intermediate_size)
        rows = 2 * self.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(self.num_experts, rows, gate_up_bytes, dtype=torch.uint8), False)
        self.down = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, down_bytes, dtype=torch.uint8), False)

    def _read(self, weight: Any, rows: slice, cols: slice) -> torch.Tensor:
        ggml_type = self.down_type if cols != slice(None) else self.gate_up_type
        return _packed_slice(weight, GGMLQuantizationType(ggml_type), rows, cols)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return True

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float(), ids, weights).to(x.dtype)

    def extra_repr(self) -> str:
        names = GGMLQuantizationType(self.gate_up_type).name, GGMLQuantizationType(self.down_type).name
        return f"experts={self.num_experts}, gate_up={names[0]}, down={names[1]}"
