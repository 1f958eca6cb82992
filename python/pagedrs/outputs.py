"""What generation returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    """1 for the most likely token."""
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's ``n`` choices."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    """Per generated token: the sampled token and the top ``logprobs`` tokens."""
    finish_reason: str | None = None
    """``"stop"``, ``"length"``, ``"abort"``, ``"capacity"`` (the request outgrew the KV
    cache), or ``"error"`` (it failed inside the engine); ``None`` while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token that ended the choice, if any."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: ``None`` for the first prompt token, then
    each prompt token's log-probability and the top tokens at its position."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (whole blocks), as vLLM reports them."""
    error: str | None = None
    """Why the request failed inside the engine (its choices then end with ``"error"``)."""
    pooled: torch.Tensor | None = None
    """A pooling request's result (`pagedrs.pooling_params`), float32 on the CPU, once it has
    finished: the embedding, or the classifier's scores. A pooling request has no choices."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`LLM.embed`), as vLLM returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]
    """Per label: the sigmoid (one label) or softmax of the classifier's logits."""


@dataclass
class ClassificationRequestOutput:
    """One prompt's classification (`LLM.classify`), as vLLM returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One text pair's score (`LLM.score`), as vLLM returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
