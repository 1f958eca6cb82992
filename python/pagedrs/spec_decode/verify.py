"""Verification of proposed tokens, in the rows the target model computed for them.

Each logits row of a speculating sequence verifies one proposal (``draft_ids[row] >= 0``) or is
its bonus row (-1). Every row is sampled so that **its token equals its proposal exactly when
the proposal is accepted**; the core then keeps the matching prefix plus one token:

- a greedy row takes the argmax (the plain sampler does it): the proposal is accepted iff it is
  the argmax;
- a sampled row accepts proposal ``d`` with probability ``min(1, p(d) / q(d))`` and otherwise
  draws from the residual ``max(p - q, 0)`` (normalized), which has no mass at ``d``. ``p`` is
  the target's distribution after the request's temperature, top-k, top-p and min-p; ``q`` is
  the draft model's under the same rules, or a point mass at ``d`` for model-free proposals (the
  rule then accepts with probability ``p(d)`` and redraws from ``p`` without ``d``). Either way
  each emitted token has the target's distribution exactly (Leviathan et al. 2023,
  Chen et al. 2023).

Sampling rules the verifier does not cover (penalties, bans before ``min_tokens``, structured
outputs) and seeded sampled requests do not speculate: see `speculates`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedrs.sample import InverseCdf, Sampler, SamplerOutput, SamplingRow, filtered_distribution
from pagedrs.sampling_params import SamplingParams


def speculates(params: SamplingParams) -> bool:
    """Whether a request's choices may speculate: every rule of its sampling is one the
    verifier applies to both distributions, and it is not a seeded sampled request (those
    promise the same text in any batch, and how many proposals a sequence gets, hence how
    many draws it makes, depends on the batch)."""
    seeded_sampling = params.seed is not None and not params.is_greedy
    return not (
        params.uses_penalties or params.min_tokens > 0 or params.structured_outputs is not None or seeded_sampling
    )


@torch.inference_mode()
def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution ``[R, V]`` under its request's temperature, top-k, top-p
    and min-p, as the sampler applies them (`pagedrs.sample.ops.filtered_distribution`). Rows must
    not be greedy."""
    device, vocab = logits.device, logits.shape[-1]
    return filtered_distribution(
        logits.float(),
        torch.tensor([p.temperature for p in params], device=device).unsqueeze(1),
        torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device=device),
        torch.tensor([p.top_p for p in params], device=device),
        torch.tensor([p.min_p for p in params], device=device).unsqueeze(1),
    )


def uniforms(sampler: Sampler, rows: Sequence[SamplingRow], per_row: int) -> torch.Tensor:
    """``[R, per_row]`` uniform draws, as the sampler makes them (a seeded row's from its own
    generator)."""
    return sampler.uniforms(range(len(rows)), [row.generator for row in rows], per_row)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` with the given uniforms ``[R]`` (the sampler's inverse CDF)."""
    return InverseCdf(probs).draw(uniform)


@torch.inference_mode()
def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Per row: the proposal if accepted, else a draw from the residual. ``draft_probs``
    ``[R, V]`` is ``q`` (``None``: a point mass at each proposal); ``uniform`` is ``[R, 2]``
    (acceptance, residual draw)."""
    rows = torch.arange(len(draft_ids), device=target_probs.device)
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs)
        draft_probs[rows, draft_ids] = 1.0
    p = target_probs[rows, draft_ids]
    q = draft_probs[rows, draft_ids]
    accepted = uniform[:, 0] * q < p  # u < p / q, without dividing by a zero q
    residual = (target_probs - draft_probs).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)  # only when p == q (then accepted)
    return torch.where(accepted, draft_ids, draw(residual, uniform[:, 1]))


def verify_and_sample(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    banned: Sequence[tuple[int, list[int]]],
    allowed: tuple[list[int], np.ndarray] | None,
    draft_ids: np.ndarray,
    draft_probs: dict[int, torch.Tensor] | None = None,
) -> SamplerOutput:
    """The step's tokens: the plain sampler for every row, then the rejection rule for the
    sampled rows that verify a proposal (``draft_probs``: ``q`` by logits row, from a draft
    model), whose tokens (and logprobs, where asked) it replaces.

    NOTE: those rows are drawn twice. They belong to requests the plain sampler treats simply
    (no penalties, bans, masks or seed: `speculates`), so the extra draw costs little, and it
    keeps the sampler's row bookkeeping whole.
    """
    sampled = sampler(logits, rows, banned, allowed)
    verify = [
        i for i, (row, draft) in enumerate(zip(rows, draft_ids.tolist())) if draft >= 0 and not row.params.is_greedy
    ]
    if not verify:
        return sampled
    verify_rows = [rows[i] for i in verify]
    index = torch.tensor(verify, device=logits.device)
    target = filtered_probs(logits[index], [row.params for row in verify_rows])
    drafts = torch.from_numpy(draft_ids[verify]).to(logits.device)
    q = None
    if draft_probs is not None:
        q = torch.stack([draft_probs[i] for i in verify]).to(target.device, torch.float32)
    verified = rejection_sample(target, drafts, q, uniforms(sampler, verify_rows, 2))
    sampled.token_ids[verify] = verified.cpu().numpy()
    asked = [i for i in verify if rows[i].params.logprobs is not None]
    logprobs, ranks, top_ids, top_logprobs = (
        sampled.logprobs,
        sampled.ranks,
        sampled.top_token_ids,
        sampled.top_logprobs,
    )
    if asked and logprobs is not None and ranks is not None and top_ids is not None and top_logprobs is not None:
        num_top = top_ids.shape[1]
        tokens = torch.from_numpy(sampled.token_ids[asked]).to(logits.device)
        columns = sampler.logprob_columns(logits[asked], tokens, num_top).cpu().numpy()
        logprobs[asked], ranks[asked] = columns[:, 0], columns[:, 1].astype(np.int64)
        top_ids[asked], top_logprobs[asked] = columns[:, 2 : 2 + num_top].astype(np.int64), columns[:, 2 + num_top :]
    return sampled
