"""Goodness of fit for sampled tokens: `chi_square_p_value` of observed counts under an exact
distribution."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of the counts under the expected distribution (cells expected >= 5 each;
    tokens the distribution excludes must never be drawn)."""
    total = counts.sum()
    assert counts[expected_probs == 0].sum() == 0, "a filtered-out token was sampled"
    expected = expected_probs * total
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)]).double()
    expected = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    observed, expected = observed[expected > 0], expected[expected > 0]
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = len(observed) - 1
    if degrees == 0:
        return 1.0
    return float(1 - torch.distributions.Chi2(torch.tensor(float(degrees))).cdf(statistic.float()))
