"""What generation returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


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
