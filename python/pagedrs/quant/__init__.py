"""Quantized weights: GGUF tensors read as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K blocks), linears that
multiply by them without a float copy (``torch.ops.pagedrs_cpu.quant_matmul``), and int8 (Q8_0)
quantization of a float checkpoint at load time."""

QUANTIZATION_CHOICES = ("auto", "none", "int8", "fp8")
"""The ``quantization`` values (``LLM``, ``pagedrs serve --quantization``, ``pagedrs memory``);
`pagedrs.quant.loading` says what each loads. Here, not there, so the command lines name them
without importing torch."""
