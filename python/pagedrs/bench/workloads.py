"""Workloads: what requests a benchmark run sends.

Generated prompts are token-id lists (the completions API takes them), drawn from a seeded
generator over a token-id range, so input lengths are exact and no tokenizer is needed on
the client. A JSONL file gives real prompts instead (``prompt`` text or chat ``messages``,
optional ``output_len``).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam


@dataclass
class RequestSpec:
    prompt: str | list[int] | None = None
    messages: list[ChatCompletionMessageParam] | None = None
    output_len: int = 64
    phase: str = "main"
    """Presets with several phases (shared-prefix: cold, then warm) label each request."""

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


@dataclass
class Lengths:
    """A length distribution: ``fixed`` (low only) or ``uniform`` over [low, high]."""

    low: int
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``"128"`` (fixed) or ``"64:256"`` (uniform, inclusive)."""
        low, _, high = str(text).partition(":")
        lengths = cls(int(low), int(high) if high else None)
        if lengths.low < 1 or (lengths.high is not None and lengths.high < lengths.low):
            raise ValueError(f"bad length distribution {text!r}: want N or LOW:HIGH with 1 <= LOW <= HIGH")
        return lengths

    def draw(self, rng: random.Random) -> int:
        return self.low if self.high is None else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.high is None else f"{self.low}:{self.high}"


@dataclass
class Preset:
    """A named workload: its defaults, and the server flags it needs when the benchmark
    launches the server itself."""

    name: str
    description: str
    num_requests: int
    input_len: str
    output_len: str
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    shared_prefix_len: int = 0
    phases: tuple[str, ...] = ("main",)
    server_args: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["request_rate"] = "inf" if self.request_rate == float("inf") else self.request_rate
        return record


PRESETS = {
    preset.name: preset
    for preset in [
        Preset(
            "cold-start",
            "process start to the first generated token of one short request",
            1,
            "16",
            "8",
            max_concurrency=1,
        ),
        Preset(
            "no-reuse",
            "random distinct prompts: steady operation with no prefix reuse",
            48,
            "64:256",
            "32:96",
            max_concurrency=16,
        ),
        Preset(
            "shared-prefix",
            "one long system prefix and distinct user turns, run cold then warm",
            32,
            "16:64",
            "32",
            max_concurrency=8,
            shared_prefix_len=512,
            phases=("cold", "warm"),
        ),
        Preset(
            "mixed-lengths",
            "short and long outputs together (8..256): continuous vs static batching",
            64,
            "16:64",
            "8:256",
        ),
        Preset(
            "memory-pressure",
            "more concurrent long requests than the KV cache holds: preemption",
            24,
            "256",
            "256",
            max_concurrency=24,
            server_args=["--kv-cache-memory", "48MiB"],
        ),
    ]
}


def token_prompt(rng: random.Random, length: int, token_range: tuple[int, int]) -> list[int]:
    return [rng.randrange(*token_range) for _ in range(length)]


def generate(
    num_requests: int,
    input_len: Lengths,
    output_len: Lengths,
    seed: int,
    token_range: tuple[int, int],
    shared_prefix_len: int = 0,
    phases: tuple[str, ...] = ("main",),
) -> list[RequestSpec]:
    """``num_requests`` per phase. With a shared prefix, every request starts with the same
    ``shared_prefix_len`` tokens (drawn fresh from ``seed``, so a new seed is a cold cache),
    followed by its own ``input_len`` tokens."""
    rng = random.Random(seed)
    prefix = token_prompt(rng, shared_prefix_len, token_range) if shared_prefix_len else []
    specs = []
    for phase in phases:
        for _ in range(num_requests):
            prompt = prefix + token_prompt(rng, input_len.draw(rng), token_range)
            specs.append(RequestSpec(prompt=prompt, output_len=output_len.draw(rng), phase=phase))
    return specs


def load_jsonl(path: str, output_len: Lengths, seed: int, limit: int | None = None) -> list[RequestSpec]:
    """One request per line: ``{"prompt": "..."}`` or ``{"messages": [...]}``, optionally
    ``"output_len": N`` (else drawn from ``output_len``)."""
    rng = random.Random(seed)
    specs = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
                raise ValueError(f"{path}:{number}: want an object with exactly one of 'prompt' and 'messages'")
            length = int(item.get("output_len") or output_len.draw(rng))
            specs.append(RequestSpec(prompt=item.get("prompt"), messages=item.get("messages"), output_len=length))
            if limit is not None and len(specs) == limit:
                break
    if not specs:
        raise ValueError(f"{path} has no requests")
    return specs
