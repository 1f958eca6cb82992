"""Whether Triton kernels can run in this process: Triton importable (it comes with torch's CUDA
wheels), and whether it runs kernels in its interpreter (CPU tensors; ``TRITON_INTERPRET=1``
set before Triton is imported, as the tests do without a GPU). The kernels themselves sit
beside their users (`pagedrs.attention.triton_kernels`, `pagedrs.layers.fused_kernels`)."""

from __future__ import annotations


def available() -> bool:
    """Whether Triton is importable here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (CPU tensors) in this process."""
    import triton

    return bool(triton.knobs.runtime.interpret)
