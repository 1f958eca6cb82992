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

from pagedrs.sampler import Sampler, SamplerOutput, SamplingRow
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
    """Each row's sampling distribution ``[R, V]`` (float32): softmax at the row's temperature,
    then top-k, top-p over the top-k survivors, and min-p relative to the most likely token, as
    the sampler applies them. Rows must not be greedy."""
    device = logits.device
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled = logits.float() / temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p) & (ranks > 0)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    drop |= (sorted_logits - sorted_logits[:, :1]).exp() < min_p
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def uniforms(sampler: Sampler, rows: Sequence[SamplingRow], per_row: int) -> torch.Tensor:
    """``[R, per_row]`` uniform draws: a seeded row's from its own generator, the others from the
    sampler's (so a seeded request stays reproducible)."""
    draws = torch.rand((len(rows), per_row), device=sampler.device, generator=sampler.generator)
    for index, row in enumerate(rows):
        if row.generator is not None:
            draws[index] = torch.rand(per_row, device=sampler.device, generator=row.generator)
    return draws


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` by inverse CDF with the given uniforms ``[R]``."""
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    # NOTE: rounding may land a draw on a zero-probability token; take the row's most likely.
    zero = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1) == 0
    return torch.where(zero, probs.argmax(dim=-1), token_ids)


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
    """The step's tokens: the plain sampler for greedy rows and rows without a proposal, the
    rejection rule for sampled rows with one (``draft_probs``: ``q`` by logits row, from a draft
    model). Logprobs, where asked, are of the token each row ends up with."""
    verify = [
        i for i, (row, draft) in enumerate(zip(rows, draft_ids.tolist())) if draft >= 0 and not row.params.is_greedy
    ]
    if not verify:
        return sampler(logits, rows, banned, allowed)
    verified_rows = set(verify)
    plain = [i for i in range(len(rows)) if i not in verified_rows]
    position = {row: index for index, row in enumerate(plain)}
    plain_out = None
    if plain:
        plain_banned = [(position[row], ids) for row, ids in banned]
        plain_allowed = None if allowed is None else ([position[row] for row in allowed[0]], allowed[1])
        plain_out = sampler(logits[plain], [rows[i] for i in plain], plain_banned, plain_allowed)
    verify_rows = [rows[i] for i in verify]
    index = torch.tensor(verify, device=logits.device)
    target = filtered_probs(logits[index], [row.params for row in verify_rows])
    drafts = torch.from_numpy(draft_ids[verify]).to(logits.device)
    q = None
    if draft_probs is not None:
        q = torch.stack([draft_probs[i] for i in verify]).to(target.device, torch.float32)
    verified = rejection_sample(target, drafts, q, uniforms(sampler, verify_rows, 2))
    token_ids = np.zeros(len(rows), dtype=np.int64)
    token_ids[verify] = verified.cpu().numpy()
    if plain_out is not None:
        token_ids[plain] = plain_out.token_ids
    num_top = max((row.params.logprobs for row in rows if row.params.logprobs is not None), default=None)
    if num_top is None:
        return SamplerOutput(token_ids)
    return _with_logprobs(sampler, logits, rows, token_ids, num_top)


def _with_logprobs(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], token_ids: np.ndarray, num_top: int
) -> SamplerOutput:
    """Logprob columns of every row that asked, for the tokens chosen."""
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    index = torch.tensor(asked, device=logits.device)
    columns = (
        sampler.logprob_columns(logits[index], torch.from_numpy(token_ids[asked]).to(logits.device), num_top)
        .cpu()
        .numpy()
    )
    num_rows = len(rows)
    logprobs, ranks = np.zeros(num_rows), np.zeros(num_rows, dtype=np.int64)
    top_ids, top_logprobs = np.zeros((num_rows, num_top), dtype=np.int64), np.zeros((num_rows, num_top))
    logprobs[asked], ranks[asked] = columns[:, 0], columns[:, 1].astype(np.int64)
    top_ids[asked], top_logprobs[asked] = columns[:, 2 : 2 + num_top].astype(np.int64), columns[:, 2 + num_top :]
    return SamplerOutput(token_ids, logprobs, ranks, top_ids, top_logprobs)
