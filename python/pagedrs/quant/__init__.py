"""Quantized weights: GGUF tensors read as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K blocks), linears that
multiply by them without a float copy (``torch.ops.pagedrs_cpu.quant_matmul``), and int8 (Q8_0)
quantization of a float checkpoint at load time."""

from typing import get_args

from pagedrs.config import Quantization

QUANTIZATION_CHOICES: tuple[str, ...] = get_args(Quantization)
"""The ``quantization`` values (`pagedrs.config.EngineConfig.quantization`); `pagedrs.quant.loading`
says what each loads."""
