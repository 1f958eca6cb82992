"""The Python side of a live request (`_Request`, one `_Choice` per ``n``): what the core does not
hold. The core holds its tokens, blocks and stop conditions; see docs/architecture.md for the
glossary of request-like types."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedrs.engine.detokenizer import IncrementalDetokenizer
from pagedrs.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sample import SamplingRow
from pagedrs.sampling_params import SamplingParams


@dataclass(frozen=True)
class StructuredOutputStats:
    """Counters of structured outputs, as the engine thread publishes them (the core's
    `GrammarMatchers` may only be read between steps)."""

    num_requests: int = 0
    """Constrained requests admitted."""
    num_compiled: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    mask_seconds: float = 0.0
    """Wall time of filling token masks (it overlaps the forward pass)."""
    num_masks: int = 0
    """Rows masked."""


@dataclass
class _Choice:
    """Python-side state of one choice of a request."""

    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    sampling: SamplingRow
    """Its parameters, seeded generator and penalty slot, as the sampler takes them."""
    banned_token_ids: list[int]
    """Tokens it may not sample while it has fewer than ``min_tokens`` (EOS, stop tokens)."""
    matcher: int | None = None
    """Its structured-output state in the core's `GrammarMatchers`, when constrained."""


@dataclass
class _Pooling:
    """A pooling request's state: what it has read of its prompt's hidden states so far."""

    params: PoolingParams
    next_position: int = 0
    """The next prompt position to read (``mean``/``cls``): a position computed again after
    a preemption is read once."""
    total: torch.Tensor | None = None
    """``mean``: the sum of the positions read; ``last``/``cls``: the position's vector."""
    result: torch.Tensor | None = None
    """The embedding or scores, once the prompt is done."""
    finish_reason: str | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (the core's count, set once scheduled)."""
    error: str | None = None
    pooling: _Pooling | None = None
    """A pooling request's state (it has no choices: its one core choice is never sampled)."""
    lora_id: int | None = None
    """Its adapter's ``lora_int_id`` (`pagedrs.lora`), if it runs with one."""
    waiting_for_slot: bool = False
    """Not yet in the scheduler: its adapter waits for a LoRA slot."""

    def finished(self) -> bool:
        if self.pooling is not None:
            return self.pooling.finish_reason is not None
        return all(choice.output.finished() for choice in self.choices)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[choice.output for choice in self.choices],
            finished=self.finished(),
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            pooled=None if self.pooling is None else self.pooling.result,
        )
