"""`inference_mode`: ``@torch.inference_mode()`` for the functions a step calls, at the price of
one check where the caller already runs in inference mode (the engine's loops enter it once).

NOTE: measured on the 2-core Sapphire Rapids VM of docs/benchmarks.md: a function under
``@torch.inference_mode()`` cost 27 us a call once a decode step's weights (96 MB) had streamed
through the caches and evicted the Python code that enters and leaves the mode, against 3 us
for a plain call and 7 us through this decorator inside the mode. A single-stream decode step
made two such calls (the model runner's forward pass and the sampler).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")


def inference_mode(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Runs ``function`` under ``torch.inference_mode``, entering it only where the calling
    thread is not in it already."""

    @functools.wraps(function)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.is_inference_mode_enabled():
            return function(*args, **kwargs)
        with torch.inference_mode():
            return function(*args, **kwargs)

    return run
