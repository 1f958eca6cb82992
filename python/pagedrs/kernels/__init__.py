"""Loaders of the compiled kernels, each built on first use and loaded once:

- `pagedrs.kernels.cpu`: the ``cpu/`` extension (``torch.ops.pagedrs_cpu``: paged attention,
  sampling, quantized matmuls, the decoder stack), ``python -m pagedrs.kernels.cpu`` builds it;
- `pagedrs.kernels.cuda`: the ``cuda/`` extension (``torch.ops.pagedrs``), and its compile-only
  check without a GPU (``python -m pagedrs.kernels.cuda --check``);
- `pagedrs.kernels.triton`: whether Triton runs here, on a GPU or in its interpreter.

The kernels' users (attention backends, the sampler, quantized linears, fused layers) import
these; none of them imports another user to reach a kernel.
"""
