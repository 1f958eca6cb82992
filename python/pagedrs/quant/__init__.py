"""Quantized weights: linears that multiply by GGUF blocks as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K,
read by `pagedrs.checkpoint.gguf`) without a float copy (``torch.ops.pagedrs_cpu.quant_matmul``),
int8 (Q8_0) quantization of a float checkpoint at load time, FP8 linears, and the loader that
picks each module's kind."""

from typing import get_args

from pagedrs.config import Quantization

QUANTIZATION_CHOICES: tuple[str, ...] = get_args(Quantization)
"""The ``quantization`` values (`pagedrs.config.EngineConfig.quantization`); `pagedrs.quant.loading`
says what each loads."""
