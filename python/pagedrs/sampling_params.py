"""Sampling parameters, validated before anything is queued."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("pagedrs")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

MIN_TEMPERATURE = 1e-2
"""Smaller positive temperatures are raised to this, as vLLM does: dividing logits by a
temperature near 0 overflows float32 (1e-320 is 0 in float32) and gives NaN probabilities.
At 0.01 the distribution is all but greedy already."""

MIN_FLOAT32_PARAM = 1e-6
"""Positive top_p and repetition_penalty below this are raised to it: the sampler works in
float32, where 1e-320 is 0 (top_p would keep nothing, a repetition penalty would divide by
0). At 1e-6 top_p keeps only the most likely token and the penalty is already extreme."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's ``StructuredOutputsParams``: exactly one of
    ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (the output is one of these strings) or ``grammar`` (Lark syntax).
    Compiled by the engine when the request is added; a schema or grammar it cannot take is a
    ``ValueError`` then."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice and grammar"
                + (f"; got {', '.join(given)}" if given else "")
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured outputs: json must be a JSON schema (an object or its JSON text)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured outputs: regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured outputs: grammar must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured outputs: choice must be a non-empty list of strings")

    def kind_and_spec(self) -> tuple[str, str]:
        """What the core's `GrammarMatchers.compile` takes: ``(kind, spec text)``."""
        if self.json is not None:
            # NOTE: keys in the schema's own order: the output writes properties in that order.
            return "json_schema", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        raise ValueError("structured outputs: no constraint given")


@dataclass
class SamplingParams:
    """How to generate, as in vLLM. ``temperature=0`` is greedy.

    Bad values raise ``ValueError`` when the object is built.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) keeps every token."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed (a 64-bit integer): the same seed gives the same text whatever else is
    in the batch."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    """``None``: up to the model's ``max_model_len``."""
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the log-probabilities of the sampled token and of this many top tokens."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token after the first, its log-probability and this many top
    tokens. Such a request never reuses cached prefix blocks (their logits are needed)."""
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output (JSON schema, regex, choice, grammar): see `StructuredOutputsParams`."""
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            # The core and torch store these as 64-bit integers; past that they overflow there.
            check(
                value is None or (isinstance(value, int) and INT64_MIN <= value <= INT64_MAX),
                f"{name} must be a 64-bit integer, got {value!r}",
            )
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}",
            )
        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g; using %g", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        self.top_p = max(self.top_p, MIN_FLOAT32_PARAM)
        check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}",
        )
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        self.repetition_penalty = max(self.repetition_penalty, MIN_FLOAT32_PARAM)
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be >= 0, got {self.min_tokens!r}",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be in [0, 20], got {self.logprobs!r}",
        )
        check(
            self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}",
        )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check(all(isinstance(s, str) and s for s in stop), "stop must be a string or a list of non-empty strings")
        self._stop = stop
        ids = list(self.stop_token_ids or [])
        check(
            all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in ids),
            "stop_token_ids must be non-negative integers (token ids of the vocabulary)",
        )
        self.stop_token_ids = ids
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams (or a dict of its fields)",
        )

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
