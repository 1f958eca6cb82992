"""`pagedrs.inference_mode`: a decorated function runs in inference mode whether or not its caller
is in it, and leaves the caller's mode as it found it."""

from __future__ import annotations

import pytest
import torch

from pagedrs.inference_mode import inference_mode


@inference_mode
def made_inside(x: torch.Tensor) -> tuple[bool, torch.Tensor]:
    return torch.is_inference_mode_enabled(), x * 2


def test_a_call_outside_inference_mode_runs_inside_it_and_leaves_it():
    assert not torch.is_inference_mode_enabled()
    enabled, y = made_inside(torch.ones(2))
    assert enabled and y.is_inference()
    assert not torch.is_inference_mode_enabled()


def test_a_call_inside_inference_mode_stays_in_it():
    with torch.inference_mode():
        enabled, y = made_inside(torch.ones(2))
        assert enabled and y.is_inference() and torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled()


def test_the_decorated_function_keeps_its_name_and_raises_through():
    @inference_mode
    def fails() -> None:
        raise ValueError("bad input")

    assert made_inside.__name__ == "made_inside"
    with pytest.raises(ValueError, match="bad input"):
        fails()
    assert not torch.is_inference_mode_enabled()
