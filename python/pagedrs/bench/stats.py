"""Latency and throughput statistics of one benchmark run, from per-request timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """What one request did, in seconds since the run started."""

    prompt_tokens: int
    output_tokens: int = 0
    expected_output_tokens: int | None = None
    """The output length asked for (``max_tokens``), when fixed."""
    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried text."""
    success: bool = False
    error: str | None = None
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, median, p90, p99 (and min, max, count) of ``values`` times ``scale``."""
    if not values:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    array = np.asarray(values, dtype=np.float64) * scale
    return {
        "count": int(array.size),
        "mean": float(array.mean()),
        "median": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
        "min": float(array.min()),
        "max": float(array.max()),
    }


@dataclass
class SLO:
    """A request is good if it met every limit given (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        def over(limit_ms: float | None, seconds: float | None) -> bool:
            return limit_ms is not None and seconds is not None and seconds * 1000 > limit_ms

        if self.ttft_ms is not None and result.ttft is None:
            return False
        # An output of one token has no TPOT, so it cannot break a TPOT limit.
        return not (over(self.ttft_ms, result.ttft) or over(self.tpot_ms, result.tpot) or over(self.e2e_ms, result.e2e))

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


def summarize(results: list[RequestResult], duration: float, slo: SLO | None = None) -> dict[str, Any]:
    """The run's numbers: counts, throughput, latency distributions in milliseconds."""
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], 1000),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None], 1000),
        "itl_ms": distribution([gap for r in ok for gap in r.itls()], 1000),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None], 1000),
    }
    mismatched = [r for r in ok if r.expected_output_tokens is not None and r.output_tokens != r.expected_output_tokens]
    summary["output_length_mismatches"] = len(mismatched)
    if slo is not None:
        good = [r for r in ok if slo.met_by(r)]
        summary["slo"] = slo.as_dict()
        summary["good_requests"] = len(good)
        summary["goodput"] = len(good) / duration if duration > 0 else 0.0
    return summary
