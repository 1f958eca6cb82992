"""RMSNorm, computed in float32 like the Hugging Face reference of each family."""

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.layers import fused


class RMSNorm(nn.Module):
    """``x / rms(x)`` in float32, then the weight, as the family's reference applies it:

    - ``llama``: cast back to the input's dtype, then times ``weight``;
    - ``float32``: times ``weight`` in float32, then cast (OLMo 2);
    - ``gemma``: times ``1 + weight`` in float32, then cast (Gemma 1/2/3).
    """

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, style: Literal["llama", "float32", "gemma"] = "llama"
    ):
        super().__init__()
        self.eps = eps
        self.style = style
        initial = torch.zeros(size, dtype=dtype) if style == "gemma" else torch.ones(size, dtype=dtype)
        self.weight = nn.Parameter(initial, requires_grad=False)

    @property
    def plain(self) -> bool:
        """Whether this is Llama's norm (what the fused kernels and the CPU stack compute)."""
        return self.style == "llama"

    def load(self, tensor: Any) -> None:
        self.weight.copy_(tensor[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain and fused.enabled(x):  # one kernel instead of eight (GPU)
            _, out = fused.add_rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)
            return out.view(x.shape)
        if self.plain and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The float32 steps below in the same order (equal bit for bit), one dispatch
            # instead of seven.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (x * (1.0 + self.weight.float())).to(dtype)
        if self.style == "float32":
            return (self.weight.float() * x).to(dtype)
        return self.weight * x.to(dtype)
