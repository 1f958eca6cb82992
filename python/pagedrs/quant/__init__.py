"""Quantized weights: GGUF tensors read as stored (Q8_0, Q4_0, Q4_1 blocks), linears that
multiply by them without a float copy (``torch.ops.pagedrs_cpu.quant_matmul``), and int8 (Q8_0)
quantization of a float checkpoint at load time."""
