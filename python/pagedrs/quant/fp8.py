"""FP8 (e4m3) weights with one float32 scale per output channel: the checkpoints vLLM serves as
``fp8`` and ``compressed-tensors`` (``float-quantized``), read as stored, and float checkpoints
quantized at load time (``quantization="fp8"``).

A weight row ``o`` dequantizes as ``w[o, i] = weight_fp8[o, i] * weight_scale[o]``. A per-tensor
scale is broadcast to every row, so a fused q/k/v whose parts carry different scalars is still
one per-channel layer. Shapes: ``x [num_tokens, in_features]``, ``weight_fp8 [out_features,
in_features]``, ``weight_scale [out_features]``.

Forward, two paths:

- ``torch._scaled_mm`` (CUDA, compute capability 8.9+: Ada, Hopper): the activations are
  quantized to e4m3 per token (dynamic scales, as vLLM's ``apply_fp8_linear``), the matmul
  runs in FP8 and each output ``[t, o]`` is scaled by ``x_scale[t] * weight_scale[o]``.
- elsewhere (CPU, older GPUs, shapes the FP8 matmul refuses): dequantize the weight and
  ``F.linear`` in the activations' dtype. On the CPU this is exact against a float model
  holding the dequantized weights (float32 both ways), up to accumulation order.

Sharding follows the dense layers (`pagedrs.layers.linear`): a column-parallel shard is a row
range with its rows' scales, a row-parallel shard a column range with every row's scale.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.checkpoint import SafetensorsHandle
from pagedrs.layers.linear import ColumnParallelLinear, RowParallelLinear, TensorParallel
from pagedrs.quant.sharding import ColumnShardBias, ReplicatedBias

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
"""448: the largest finite e4m3 value; quantizers scale each row's maximum to it."""

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
"""Checkpoint tensors folded into their weight's handle (or, ``input_scale``, unused: pagedrs
always quantizes activations per token, which is at least as accurate as a static scale)."""


# --------------------------------------------------------------------------- checkpoint format


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's ``quantization_config`` says about its FP8 weights."""

    quant_method: str
    """``"fp8"`` or ``"compressed-tensors"``."""
    block_size: tuple[int, int] | None
    """``weight_block_size`` of block-wise FP8 (DeepSeek-style ``weight_scale_inv``). The FP8
    layers hold one scale a row, so such weights load dequantized (``"auto"``, ``"none"``) or
    requantized per channel from the dequantized values (``"fp8"``)."""

    @property
    def per_channel(self) -> bool:
        """Whether the FP8 layers can hold the weights as stored (per-channel or per-tensor
        scales, not block-wise)."""
        return self.block_size is None


def checkpoint_scheme(directory: str) -> Fp8Scheme | None:
    """The FP8 scheme of a Hugging Face checkpoint directory; ``None`` for a float checkpoint.
    A ``quantization_config`` pagedrs cannot load raises ``ValueError`` naming what it can."""
    import json

    with open(os.path.join(directory, "config.json")) as file:
        qconfig = json.load(file).get("quantization_config")
    if qconfig is None:
        return None
    method = qconfig.get("quant_method")
    supported = (
        "pagedrs loads float checkpoints, GGUF files and FP8 checkpoints (quant_method 'fp8', or "
        "'compressed-tensors' in format 'float-quantized' with 8-bit float weights per channel or tensor)"
    )
    if method == "mxfp4":  # gpt-oss: MXFP4 experts, dequantized by the model's loader (`pagedrs.quant.mxfp4`)
        return None
    if method == "fp8":
        block = qconfig.get("weight_block_size")
        return Fp8Scheme("fp8", (int(block[0]), int(block[1])) if block else None)
    if method != "compressed-tensors":
        raise ValueError(f"checkpoint quant_method {method!r} is not supported: {supported}")
    block_size = None
    for group_name, group in (qconfig.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        group_format = group.get("format") or qconfig.get("format")
        if group_format not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {group_format!r} ({group_name}) is not supported: {supported}")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"compressed-tensors {group_name} has {weights.get('num_bits')}-bit {weights.get('type')} "
                f"weights: {supported}"
            )
        strategy = weights.get("strategy")
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            block_size = (int(block[0]), int(block[1]))
        elif strategy not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors {group_name} has {strategy!r} weight scales: {supported}")
    return Fp8Scheme("compressed-tensors", block_size)


class Fp8WeightHandle:
    """An FP8 checkpoint weight and its scale, read lazily like `pagedrs.checkpoint.WeightHandle`:
    indexing (``h[rows]``, ``h[:, cols]``) dequantizes just that slice to float32, so dense
    layers load it as any float tensor; `fp8_slice` gives the stored e4m3 values and per-row
    scales to the FP8 layers."""

    def __init__(self, file: Any, name: str, scale: torch.Tensor, block_size: tuple[int, int] | None):
        self._slice = file.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.block_size = block_size
        out_features = self.shape[0]
        scale = scale.float()
        if block_size is not None:
            self._scale = scale  # [ceil(out / b0), ceil(in / b1)]
        elif scale.numel() == 1:
            self._scale = scale.reshape(1).expand(out_features)  # per tensor
        elif scale.numel() == out_features:
            self._scale = scale.reshape(out_features)  # per channel ([out] or [out, 1])
        else:
            raise ValueError(f"{name}: a scale of shape {tuple(scale.shape)} is neither per tensor nor per channel")

    def _rows_cols(self, index: Any) -> tuple[slice, slice]:
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else index
        if not isinstance(rows, slice) or not isinstance(cols, slice):
            raise ValueError(f"an FP8 weight is read by row or column ranges, not {index!r}")
        return rows, cols

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = self._rows_cols(index)
        values = self._slice[rows, cols].float()
        if self.block_size is None:
            return values * self._scale[rows, None]
        b0, b1 = self.block_size
        full = self._scale.repeat_interleave(b0, 0)[: self.shape[0]].repeat_interleave(b1, 1)[:, : self.shape[1]]
        return values * full[rows, cols]

    def fp8_slice(self, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight_fp8[rows, cols], scale[rows])`` as stored (per-channel scales only)."""
        if self.block_size is not None:
            raise ValueError(
                "block-wise FP8 weights (weight_block_size) have no per-channel scales: they load dequantized "
                "(quantization='auto' or 'none') or requantized per channel ('fp8')"
            )
        return self._slice[rows, cols], self._scale[rows].clone()


def iter_fp8_weights(directory: str, scheme: Fp8Scheme) -> Iterator[tuple[str, Any]]:
    """An FP8 checkpoint's tensors by Hugging Face name: each e4m3 weight as an
    `Fp8WeightHandle` holding its scale (found in whichever file holds it), float tensors as
    plain lazy handles, the scale tensors themselves folded away."""
    from safetensors import safe_open

    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not paths:
        raise ValueError(f"an FP8 checkpoint needs *.safetensors weights; {directory!r} has none")
    with ExitStack() as stack:
        files = [stack.enter_context(safe_open(path, framework="pt")) for path in paths]
        name_to_file = {name: file for file in files for name in file.keys()}
        for name, file in name_to_file.items():
            if name.endswith(SCALE_SUFFIXES):
                continue
            if file.get_slice(name).get_dtype() != "F8_E4M3":
                yield name, SafetensorsHandle(file, name)
                continue
            # "weight_scale" (compressed-tensors, fp8); "weight_scale_inv" (block-wise fp8).
            scale_name = next((name + s for s in ("_scale", "_scale_inv") if name + s in name_to_file), None)
            if scale_name is None:
                raise ValueError(f"FP8 weight {name!r} has no weight_scale in the checkpoint")
            scale = name_to_file[scale_name].get_tensor(scale_name)
            yield name, Fp8WeightHandle(file, name, scale, scheme.block_size)


def fp8_weight_names(directory: str) -> set[str]:
    """Names of a checkpoint's tensors stored as e4m3 (read from the files' headers only)."""
    from safetensors import safe_open

    names = set()
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as file:
            names |= {name for name in file.keys() if file.get_slice(name).get_dtype() == "F8_E4M3"}
    return names


# --------------------------------------------------------------------------- arithmetic


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight_fp8 [out, in], scale [out] float32)`` with each row's largest magnitude at
    ``FP8_MAX`` (as vLLM's ``--quantization fp8`` with channel scales); an all-zero row gets
    scale 1."""
    weight = weight.float()
    amax = weight.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [num_tokens, in], scale [num_tokens, 1] float32)``: dynamic activation scales."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    # NOTE: vLLM's floor on the scale; an all-zero row then quantizes to zeros.
    scale = (amax / FP8_MAX).clamp(min=1 / (FP8_MAX * 512))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight_fp8: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[out, in]``."""
    return weight_fp8.float() * weight_scale[:, None]


@functools.cache
def _has_fp8_matmul(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_runs_on(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 matmuls on ``device`` (CUDA, sm_89 or newer)."""
    if device.type != "cuda":
        return False
    return _has_fp8_matmul(device.index if device.index is not None else torch.cuda.current_device())


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, scaled_mm: bool) -> torch.Tensor:
    """``x @ dequantize(weight_fp8, weight_scale)^T`` in x's dtype: FP8 activations through
    ``torch._scaled_mm`` when ``scaled_mm`` (and the shapes allow: multiples of 16), else the
    dequantized weight through ``F.linear``."""
    out_features, in_features = weight_fp8.shape
    if not scaled_mm or in_features % 16 or out_features % 16:
        return F.linear(x, dequantize(weight_fp8, weight_scale).to(x.dtype))
    flat = x.reshape(-1, in_features)
    if flat.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    x_fp8, x_scale = quantize_per_token(flat)
    # weight_fp8.t() is column-major, as _scaled_mm wants its second operand.
    if x.dtype == torch.bfloat16:
        # Row-wise scales are applied inside the matmul (cuBLASLt wants a bfloat16 output).
        out = torch._scaled_mm(
            x_fp8, weight_fp8.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16
        )
    else:
        # Other dtypes (vLLM's channel-wise fallback): unit scales, a float32 product, then the
        # row and column scales.
        one = torch.ones((), dtype=torch.float32, device=x.device)
        out = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        out = (out * x_scale * weight_scale.view(1, -1)).to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


# --------------------------------------------------------------------------- layers


def _fp8_slice(weight: Any, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight[rows, cols]`` (one of them ``slice(None)``) as e4m3 values and per-row scales:
    as stored for an FP8 checkpoint's per-channel handle, quantized per channel from the float
    values otherwise (a float tensor, or a block-wise handle's dequantized values)."""
    if hasattr(weight, "fp8_slice") and getattr(weight, "block_size", None) is None:
        return weight.fp8_slice(rows, cols)
    return quantize_per_channel(weight[rows] if cols == slice(None) else weight[:, cols])


class _Fp8Linear(nn.Module):
    """Holds ``weight`` (e4m3 ``[rows, in_features]``) and ``weight_scale`` (float32 ``[rows]``).

    NOTE: ``weight`` is a parameter named like the dense layer's, so the model's loader still
    finds a checkpoint tensor missing; the scale is a buffer (the loader's expected tensors are
    the parameters, and the checkpoint's scale arrives inside the weight's handle)."""

    weight_scale: torch.Tensor

    def __init__(self, rows: int, in_features: int, bias: nn.Parameter | None):
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.zeros(rows, in_features, dtype=FP8), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(rows, dtype=torch.float32))
        self.bias = bias
        self.scaled_mm: bool | None = None
        """``torch._scaled_mm`` or the dequantizing fallback; ``None``: by the device."""

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        scaled_mm = self.scaled_mm if self.scaled_mm is not None else scaled_mm_runs_on(x.device)
        return fp8_linear(x, self.weight, self.weight_scale, scaled_mm)

    def extra_repr(self) -> str:
        return f"fp8 e4m3 per-channel, out={self.weight.shape[0]}, in={self.in_features}"


class Fp8ColumnParallelLinear(ColumnShardBias, _Fp8Linear):
    """`ColumnParallelLinear` with FP8 rows: this rank's rows of each fused logical output."""

    def __init__(self, dense: ColumnParallelLinear):
        super().__init__(dense.weight.shape[0], dense.weight.shape[1], dense.bias)
        # The dense layer's own rule for which rows this rank holds, per logical output.
        self.shard_rows = [dense._rows(shard) for shard in range(len(dense.output_sizes))]

    def load(self, shard: int, weight: Any) -> None:
        source, target = self.shard_rows[shard]
        values, scale = _fp8_slice(weight, source, slice(None))
        self.weight[target].copy_(values)
        self.weight_scale[target].copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return out + self.bias if self.bias is not None else out


class Fp8RowParallelLinear(ReplicatedBias, _Fp8Linear):
    """`RowParallelLinear` with FP8 columns of this rank's input features and every row's
    scale; partial sums are all-reduced across ranks, the bias added once after."""

    def __init__(self, dense: RowParallelLinear):
        super().__init__(dense.weight.shape[0], dense.input_size, dense.bias)
        self.tp: TensorParallel = dense.tp
        self.input_cols = dense.input_cols()  # the dense layer's rule for this rank's columns

    def load(self, weight: Any) -> None:
        values, scale = _fp8_slice(weight, slice(None), self.input_cols)
        self.weight.copy_(values)
        self.weight_scale.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        if self.tp.size > 1:
            torch.distributed.all_reduce(out)
        return out + self.bias if self.bias is not None else out
