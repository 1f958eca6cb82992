"""``--speculative-config``: which proposer, how many tokens, when to step aside."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any

from pagedrs._core import MAX_SPECULATIVE_TOKENS

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, with vLLM's keys:

    - ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
      "prompt_lookup_max": b}``: prompt lookup (the core's n-gram index);
    - ``{"method": "suffix", "num_speculative_tokens": k, ...}``: suffix decoding over the
      request's tokens and recent outputs (``suffix_decoding_*`` keys);
    - ``{"model": PATH, "num_speculative_tokens": k}``: a draft model sharing the target's
      tokenizer (``"method": "draft_model"`` may be given or left out).

    ``disable_by_batch_size``: no sequence speculates in a step that starts with this many
    running sequences or more (a big batch is compute-bound, and verifying proposals costs
    more than it saves). Unlike vLLM, where ``None`` never steps aside, ``None`` here keeps
    the device's default (`default_disable_by_batch_size`: 4 on CPU) and 0 never steps
    aside.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    disable_by_batch_size: int | None = None

    @staticmethod
    def parse(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict, its JSON text, or ``None`` (no speculation). Unknown keys, a missing
        ``num_speculative_tokens`` or bad values raise ``ValueError``. ``prompt_lookup_min``
        and ``prompt_lookup_max`` come back resolved (`lookup_range`)."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            return value._resolved()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        known = {field.name for field in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative config keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        value = dict(value)
        method = value.pop("method", None)
        if method is None:
            method = "draft_model" if value.get("model") is not None else None
        if method == "draft":
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(
                f"speculative config: method must be one of {', '.join(METHODS)} (or give a model), got {method!r}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative config: num_speculative_tokens is required")
        config = SpeculativeConfig(method=method, **value)
        config.check()
        return config._resolved()

    def check(self) -> None:
        def positive_int(name: str, value: Any, low: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"speculative config: {name} must be an integer >= {low}, got {value!r}")

        positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative config: the draft_model method needs a model")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative config: method {self.method!r} takes no model")
        low, high = self.lookup_range()
        positive_int("prompt_lookup_min", low)
        positive_int("prompt_lookup_max", high)
        if low > high:
            raise ValueError(f"speculative config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        positive_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 2)
        if self.suffix_decoding_max_tree_depth > 255:
            raise ValueError(
                "speculative config: suffix_decoding_max_tree_depth must be at most 255, "
                f"got {self.suffix_decoding_max_tree_depth}"
            )
        positive_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        probability = self.suffix_decoding_min_token_prob
        if not _is_number(probability) or not 0 <= probability <= 1:
            raise ValueError(
                f"speculative config: suffix_decoding_min_token_prob must be in [0, 1], got {probability!r}"
            )
        factor = self.suffix_decoding_max_spec_factor
        if not _is_number(factor) or not 0 < factor < math.inf:
            raise ValueError(f"speculative config: suffix_decoding_max_spec_factor must be positive, got {factor!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative config: model must be a path, got {self.model!r}")
        if self.disable_by_batch_size is not None:
            positive_int("disable_by_batch_size", self.disable_by_batch_size, 0)

    def _resolved(self) -> SpeculativeConfig:
        """This config with ``prompt_lookup_min``/``prompt_lookup_max`` filled in."""
        low, high = self.lookup_range()
        return dataclasses.replace(self, prompt_lookup_min=low, prompt_lookup_max=high)

    def lookup_range(self) -> tuple[int, int]:
        """``(prompt_lookup_min, prompt_lookup_max)`` as vLLM fills them in: one given alone
        sets both ends, neither gives 5..5."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None:
            return (5, 5) if high is None else (high, high)
        return low, low if high is None else high

    def effective_disable_by_batch_size(self, device_type: str) -> int | None:
        """Running sequences at which speculation steps aside on this device (``None``:
        never)."""
        disable = self.disable_by_batch_size
        if disable is None:
            disable = default_disable_by_batch_size(device_type)
        return disable or None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def default_disable_by_batch_size(device_type: str) -> int:
    """Running sequences at which speculation steps aside unless the config says otherwise.

    On CPU, 4: verifying proposals is compute there (the default model's forward takes 13 ms
    for 1 token, 24 ms for 5, 40 ms for 9), and at 32 sequences of mixed traffic speculation
    forced on costs 4-19%; the threshold is conservative (copy-heavy text still gains at 16:
    docs/benchmarks.md, "Speculative decoding"). On a GPU, 0 (never steps aside), as vLLM: a
    decode batch stays memory-bound far longer there; not yet measured here.
    """
    return 4 if device_type == "cpu" else 0
