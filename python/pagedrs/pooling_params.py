"""`PoolingParams`: what a prefill-only request returns instead of generated tokens (vLLM's
name and fields).

A pooling request runs its prompt through the model like any prompt (same scheduler, same
token budget, same batches as generation) and ends when the prompt is done: no token is
sampled, its KV blocks are freed at once. What it returns is the last layer's hidden states
(after the final norm), pooled into one vector:

- ``task="embed"``: the vector itself, cut to ``dimensions`` (Matryoshka) and scaled to unit
  length when ``normalize``;
- ``task="classify"``: the vector through the model's classifier head (a
  ``*ForSequenceClassification`` checkpoint's ``score``), then a sigmoid (one label) or a
  softmax (several), as vLLM scores.

Poolers: ``last`` (the last prompt token: vLLM's default for decoder models), ``mean`` (the
average over every prompt token) and ``cls`` (the first token). ``mean`` and ``cls`` read
positions a cached prefix would skip, so such a request computes its whole prompt (it still
leaves its blocks in the prefix cache for others); ``last`` reuses cached prefixes like
generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

PoolingType = Literal["last", "mean", "cls"]
PoolingTask = Literal["embed", "classify"]


@dataclass(frozen=True)
class PoolingParams:
    task: PoolingTask = "embed"
    pooling_type: PoolingType = "last"
    normalize: bool = True
    """Embeddings only: scale the (cut) vector to unit length."""
    dimensions: int | None = None
    """Embeddings only: keep the first ``dimensions`` features (Matryoshka), before normalizing."""
    activation: bool = True
    """Classification only: a sigmoid (one label) or softmax over the head's logits; ``False``
    returns the raw logits."""

    def __post_init__(self) -> None:
        if self.task not in get_args(PoolingTask):
            raise ValueError(f"task must be one of {', '.join(get_args(PoolingTask))}, got {self.task!r}")
        if self.pooling_type not in get_args(PoolingType):
            raise ValueError(
                f"pooling_type must be one of {', '.join(get_args(PoolingType))}, got {self.pooling_type!r}"
            )
        for name in ("normalize", "activation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
            if self.task != "embed":
                raise ValueError("dimensions applies to embeddings only")

    @property
    def reads_every_position(self) -> bool:
        """Whether the pooler reads positions before the last (every one for ``mean``, the
        first for ``cls``): the request then computes its whole prompt rather than reusing a
        cached prefix."""
        return self.pooling_type != "last"
