"""Turns logits into tokens: penalties, greedy or temperature / top-k / top-p / min-p
sampling with per-request generators, and logprobs. Batched in torch; the only Python loops
are per request (seeded draws, penalty counts), never per vocabulary entry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrs.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one logits row."""

    params: SamplingParams
    generator: torch.Generator | None
    """The choice's own generator when it has a seed; ``None`` uses the engine's."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]
    """Tokens that may not be sampled now (EOS and stop tokens before ``min_tokens``)."""


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor
    """``long [R]``"""
    logprobs: torch.Tensor | None
    """Log-probabilities of the sampled tokens under the model's distribution. ``[R]``"""
    top_token_ids: torch.Tensor | None
    """``long [R, K]`` with K the largest ``logprobs`` asked for in the batch."""
    top_logprobs: torch.Tensor | None
    """``[R, K]``"""
    ranks: torch.Tensor | None
    """Rank of each sampled token (1 = most likely). ``long [R]``"""


class Sampler:
    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu"):
        # Generators live on the device of the logits they sample from.
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        raw = logits.float()
        # Copy only when something edits the logits (the raw ones give the logprobs).
        edits = any(sample.params.uses_penalties or sample.banned_token_ids for sample in rows)
        logits = raw.clone() if edits else raw
        if edits:
            self._apply_penalties(logits, rows)
            for row, sample in enumerate(rows):
                if sample.banned_token_ids:
                    logits[row, sample.banned_token_ids] = float("-inf")
        token_ids = logits.argmax(dim=-1)
        random_rows = [row for row, sample in enumerate(rows) if not sample.params.is_greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs = self._filtered_probs(logits[index], [rows[row].params for row in random_rows])
            for position, row in enumerate(random_rows):
                generator = rows[row].generator or self.generator
                token_ids[row] = torch.multinomial(probs[position], 1, generator=generator)[0]
        return self._with_logprobs(raw, token_ids, rows)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = logits.shape[-1]
        for row, sample in enumerate(rows):
            params = sample.params
            if not params.uses_penalties:
                continue
            output = torch.tensor(sample.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(output, minlength=vocab)[:vocab].float()
            if params.repetition_penalty != 1:
                # Hugging Face's rule over prompt and output tokens: shrink positive logits,
                # push negative ones further down.
                seen = torch.unique(
                    torch.tensor(sample.prompt_token_ids + sample.output_token_ids, dtype=torch.long, device=logits.device)
                )
                values = logits[row, seen]
                logits[row, seen] = torch.where(
                    values > 0, values / params.repetition_penalty, values * params.repetition_penalty
                )
            # OpenAI's rule over generated tokens.
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        logits = logits / temperature
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device).clamp(max=vocab)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # top-p: drop a token once the tokens before it already reach p (keep at least one).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (before >= top_p.unsqueeze(1)) & (ranks > 0)
        # min-p: drop tokens less likely than min_p times the most likely one.
        drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return filtered.softmax(dim=-1)

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        num_top = max((row.params.logprobs for row in rows if row.params.logprobs is not None), default=None)
        if num_top is None:
            return SamplerOutput(token_ids, None, None, None, None)
        logprobs = raw.log_softmax(dim=-1)
        sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
        return SamplerOutput(token_ids, sampled, top_ids, top_logprobs, ranks)
