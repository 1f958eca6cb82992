"""Turns a step's logits into tokens for the whole batch at once.

Per step, rows are split by what they ask for, and each group pays only for its own rules:

- **greedy** rows (``temperature == 0``): one ``argmax``;
- **windowed** rows (a ``top_k`` up to `MAX_TOP_K_WINDOW`, or a ``top_p`` whose nucleus fits in
  the `TOP_P_WINDOW` most likely tokens): one ``topk`` over all of them, then top-k, top-p and
  min-p on the small ``[rows, window]`` tensor and an exponential race (``argmax(p / q)`` with
  ``q ~ Exp(1)``, i.e. the Gumbel-max trick) to draw;
- **full** rows (temperature alone, min-p, or a nucleus wider than the window): softmax,
  min-p by a threshold against the row's maximum (no sort), inverse-CDF draw with one uniform
  per row; only a row whose top-p or top-k did not fit the window is sorted.

Unseeded rows share one batched draw from the engine's generator. A seeded row draws from its
own generator, and how much it draws depends only on its own parameters and logits, so a
seeded request gives the same text alone or in any batch.

Filtering order, as in Hugging Face: temperature, then top-k, then top-p on the distribution
renormalized over the top-k survivors, then min-p (relative to the most likely token, so its
place in the order does not matter).

Penalties read count tensors kept on the device per running choice (`PenaltyState`), updated
with each step's sampled tokens; logprobs, ranks and top logprobs are computed for the rows
that asked, and everything the engine needs comes back in one device-to-host copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedrs.sampling_params import SamplingParams

MAX_TOP_K_WINDOW = 1024
"""Largest ``top_k`` served by ``torch.topk``; a larger one sorts its row."""
TOP_P_WINDOW = 256
"""Candidates a top-p row (without a smaller top-k) looks at before falling back to a sort."""


@dataclass(eq=False)
class SamplingRow:
    """What the sampler needs to know about one running choice; built once per choice and
    handed over for every logits row it owns (identity, not value, decides equality)."""

    params: SamplingParams
    generator: torch.Generator | None
    """The choice's own generator when it has a seed; ``None`` uses the engine's."""
    penalty_slot: int | None = None
    """Its row in the sampler's `PenaltyState`, when the choice uses penalties."""

    def window(self, vocab_size: int) -> int:
        """Candidates this row's top-k / top-p look at; 0: the whole vocabulary."""
        top_k = self.params.top_k if 0 < self.params.top_k < vocab_size else 0
        if top_k > MAX_TOP_K_WINDOW:
            return 0
        if top_k:
            return top_k
        return min(TOP_P_WINDOW, vocab_size) if self.params.top_p < 1 else 0


@dataclass
class SamplerOutput:
    """One step's sampled tokens and logprobs, on the host."""

    token_ids: np.ndarray
    """``int64 [R]``"""
    logprobs: np.ndarray | None = None
    """Log-probability of each sampled token under the model's raw distribution. ``float64 [R]``
    (rows that did not ask for logprobs hold 0)."""
    ranks: np.ndarray | None = None
    """Rank of each sampled token (1 = most likely). ``int64 [R]``"""
    top_token_ids: np.ndarray | None = None
    """``int64 [R, K]`` with K the largest ``logprobs`` asked for in the batch."""
    top_logprobs: np.ndarray | None = None
    """``float64 [R, K]``"""


class PenaltyState:
    """Per choice that uses penalties: how often it generated each token, and which tokens its
    prompt holds. Lives on the device; a slot is taken when the choice is added, freed when it
    ends, and each step adds the sampled tokens with one ``index_put_``."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, device=device)
        """``float32 [slots, vocab]`` (exact counts up to 2**24)"""
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        """``bool [slots, vocab]``"""
        self._free_slots: list[int] = []

    @property
    def num_slots_in_use(self) -> int:
        return len(self.output_counts) - len(self._free_slots)

    def acquire(self, prompt_token_ids: list[int]) -> int:
        if not self._free_slots:
            old = len(self.output_counts)
            new = max(8, 2 * old)
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab_size)])
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(new - old, self.vocab_size)])
            self._free_slots.extend(range(new - 1, old - 1, -1))
        slot = self._free_slots.pop()
        self.output_counts[slot] = 0
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, torch.tensor(prompt_token_ids, dtype=torch.long, device=self.device)] = True
        return slot

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, presence: torch.Tensor,
              frequency: torch.Tensor, repetition: torch.Tensor | None) -> None:
        """Penalizes ``logits[rows]`` in place. Repetition (Hugging Face's rule, over prompt and
        output tokens) shrinks positive logits and pushes negative ones further down; presence
        and frequency (OpenAI's rule) subtract over generated tokens."""
        counts = self.output_counts[slots]
        selected = logits[rows]
        if repetition is not None:
            seen = self.prompt_mask[slots] | (counts > 0)
            factor = repetition.unsqueeze(1)
            selected = torch.where(seen, torch.where(selected > 0, selected / factor, selected * factor), selected)
        selected -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
        logits[rows] = selected

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        ones = torch.ones(len(slots), device=self.device)
        self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


class _Batch:
    """A step's rows, grouped, with their parameters as device vectors. Rebuilt only when the
    rows change (in steady decoding they don't)."""

    def __init__(self, rows: list[SamplingRow], vocab_size: int, device: torch.device):
        params = [row.params for row in rows]
        self.num_rows = len(rows)
        self.greedy = [i for i, p in enumerate(params) if p.is_greedy]
        self.random = [i for i, p in enumerate(params) if not p.is_greedy]
        self.random_index = _index(self.random, device)
        # From here on, rows are positions within the random rows.
        self.params = [params[i] for i in self.random]
        self.generators = [rows[i].generator for i in self.random]
        windows = [rows[i].window(vocab_size) for i in self.random]
        self.windowed = [j for j, window in enumerate(windows) if window]
        self.full = [j for j, window in enumerate(windows) if not window]
        self.window = max((windows[j] for j in self.windowed), default=0)
        self.any_seeded = any(generator is not None for generator in self.generators)
        self.any_min_p = any(p.min_p > 0 for p in self.params)
        self.temperature = torch.tensor([p.temperature for p in self.params], device=device).unsqueeze(1)
        self.log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in self.params],
                                      device=device)
        self.top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else 0 for p in self.params], device=device)
        self.top_p = torch.tensor([p.top_p for p in self.params], device=device)
        if self.windowed:
            self.windowed_index = _index(self.windowed, device)
            windowed_params = [self.params[j] for j in self.windowed]
            self.windowed_width = [windows[j] for j in self.windowed]
            self.row_window = torch.tensor(self.windowed_width, device=device).unsqueeze(1)
            has_top_k = [0 < p.top_k < vocab_size for p in windowed_params]
            self.has_top_k = torch.tensor(has_top_k, device=device)
            self.all_top_k = all(has_top_k)
            self.any_top_p = any(p.top_p < 1 for p in windowed_params)

        penalized = [i for i, row in enumerate(rows) if row.penalty_slot is not None]
        self.penalty_rows = _index(penalized, device) if penalized else None
        if penalized:
            self.penalty_slots = _index([rows[i].penalty_slot for i in penalized], device)
            self.presence = torch.tensor([params[i].presence_penalty for i in penalized], device=device)
            self.frequency = torch.tensor([params[i].frequency_penalty for i in penalized], device=device)
            repetition = [params[i].repetition_penalty for i in penalized]
            self.repetition = torch.tensor(repetition, device=device) if any(r != 1 for r in repetition) else None

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.logprob_rows = _index(logprob_rows, device) if logprob_rows else None
        self.all_logprobs = len(logprob_rows) == len(rows)
        self.num_top_logprobs = max((params[i].logprobs for i in logprob_rows), default=0)


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Generators live on the device of the logits they sample from.
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        self.penalties = PenaltyState(vocab_size, self.device)
        self._last_rows: list[SamplingRow] = []
        self._last_batch: _Batch | None = None

    def _batch(self, rows: list[SamplingRow]) -> _Batch:
        if self._last_batch is None or rows != self._last_rows:
            self._last_rows, self._last_batch = list(rows), _Batch(rows, self.vocab_size, self.device)
        return self._last_batch

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 banned: list[tuple[int, list[int]]] = ()) -> SamplerOutput:
        """``logits``: ``[R, vocab]``, one row per entry of ``rows``. ``banned``: ``(row, token
        ids)`` that may not be sampled now (EOS and stop tokens before ``min_tokens``)."""
        batch = self._batch(rows)
        raw = logits.float()
        logits = raw
        if batch.penalty_rows is not None or banned:
            logits = raw.clone()  # the raw logits give the logprobs
            if batch.penalty_rows is not None:
                self.penalties.apply(logits, batch.penalty_rows, batch.penalty_slots, batch.presence,
                                     batch.frequency, batch.repetition)
            if banned:
                ban_rows = [row for row, token_ids in banned for _ in token_ids]
                ban_ids = [token for _, token_ids in banned for token in token_ids]
                logits[_index(ban_rows, self.device), _index(ban_ids, self.device)] = float("-inf")
        if not batch.random:
            token_ids = logits.argmax(dim=-1)
        elif not batch.greedy:
            token_ids = self._sample(logits, batch)
        else:
            token_ids = logits.argmax(dim=-1)
            token_ids[batch.random_index] = self._sample(logits[batch.random_index], batch)
        if batch.penalty_rows is not None:
            self.penalties.record(batch.penalty_slots, token_ids[batch.penalty_rows])
        return self._to_host(raw, token_ids, batch)

    def _sample(self, logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """Draws one token per row of ``logits`` (the batch's random rows)."""
        scaled = logits / batch.temperature
        token_ids = torch.empty(len(scaled), dtype=torch.long, device=scaled.device)
        full = list(batch.full)
        if batch.windowed:
            index = batch.windowed_index
            chosen, misfits = self._sample_windowed(scaled[index] if batch.full else scaled, batch)
            token_ids[index] = chosen
            full = sorted(full + misfits)
        if full:
            index = _index(full, scaled.device)
            token_ids[index] = self._sample_full(scaled[index] if len(full) < len(scaled) else scaled, full, batch)
        return token_ids

    def _sample_windowed(self, scaled: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor, list[int]]:
        """Rows whose candidates are their ``window`` most likely tokens. Returns the drawn
        tokens and the rows whose nucleus did not fit (to be drawn again over everything)."""
        index = batch.windowed_index
        values, token_ids = scaled.topk(batch.window, dim=-1)  # sorted, most likely first
        ranks = torch.arange(batch.window, device=scaled.device).unsqueeze(0)
        keep = ranks < batch.row_window  # a row's window is its top-k when it has one
        misfits: list[int] = []
        if batch.any_top_p:
            # top-p over the top-k survivors, or over the whole vocabulary without a top-k.
            normalizer = values.masked_fill(~keep, float("-inf")).logsumexp(dim=-1)
            if not batch.all_top_k:
                normalizer = torch.where(batch.has_top_k, normalizer, scaled.logsumexp(dim=-1))
            probs = (values - normalizer.unsqueeze(1)).exp().masked_fill(~keep, 0.0)
            before = probs.cumsum(dim=-1) - probs
            top_p = batch.top_p[index].unsqueeze(1)
            keep &= ~((before >= top_p) & (ranks > 0))
            if not batch.all_top_k:
                # NOTE: without a top-k, the window holds the whole nucleus iff its mass reaches
                # top_p (every token past it then has at least top_p before it).
                fits = batch.has_top_k | (probs.sum(dim=-1) >= top_p.squeeze(1))
                if not bool(fits.all()):
                    misfits = [batch.windowed[j] for j in torch.nonzero(~fits).flatten().tolist()]
        if batch.any_min_p:
            keep &= values >= values[:, :1] + batch.log_min_p[index].unsqueeze(1)
        race = torch.empty_like(values).exponential_(generator=self.generator)
        if batch.any_seeded:
            # A seeded row draws its own window's worth, whatever the batch's window is.
            for row, position in enumerate(batch.windowed):
                generator = batch.generators[position]
                if generator is not None:
                    race[row, : batch.windowed_width[row]].exponential_(generator=generator)
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        chosen = (values - values[:, :1]).exp_().masked_fill_(~keep, 0.0).div_(race).argmax(dim=-1)
        return token_ids.gather(1, chosen.unsqueeze(1)).squeeze(1), misfits

    def _sample_full(self, scaled: torch.Tensor, positions: list[int], batch: _Batch) -> torch.Tensor:
        """Rows drawn over the whole vocabulary by inverse CDF (min-p by a threshold against
        the row's maximum; a sort only for a row whose top-k / top-p did not fit a window)."""
        index = _index(positions, scaled.device)
        sort_rows = [row for row, position in enumerate(positions)
                     if batch.params[position].top_p < 1 or batch.params[position].top_k > 0]
        if sort_rows:
            rows = _index(sort_rows, scaled.device)
            scaled[rows] = _sort_filtered(scaled[rows], batch.top_k[index[rows]], batch.top_p[index[rows]])
        if batch.any_min_p:
            threshold = scaled.amax(dim=-1) + batch.log_min_p[index]
            scaled = scaled.masked_fill(scaled < threshold.unsqueeze(1), float("-inf"))
        probs = scaled.softmax(dim=-1)
        cdf = probs.cumsum(dim=-1)
        uniform = torch.rand(len(positions), device=scaled.device, generator=self.generator)
        if batch.any_seeded:
            for row, position in enumerate(positions):
                generator = batch.generators[position]
                if generator is not None:
                    uniform[row] = torch.rand(1, device=scaled.device, generator=generator)[0]
        target = (uniform * cdf[:, -1]).unsqueeze(1)
        token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
        # NOTE: float32 rounding may put the target at (or past) the end, or on a masked
        # token's flat stretch of the CDF; such a draw takes the row's most likely token.
        token_ids.clamp_(max=scaled.shape[-1] - 1)
        masked = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1) == 0
        if bool(masked.any()):
            token_ids[masked] = probs[masked].argmax(dim=-1)
        return token_ids

    def _to_host(self, raw: torch.Tensor, token_ids: torch.Tensor, batch: _Batch) -> SamplerOutput:
        """Logprobs of the rows that asked, and one device-to-host copy of everything."""
        if batch.logprob_rows is None:
            return SamplerOutput(token_ids.cpu().numpy())
        rows = None if batch.all_logprobs else batch.logprob_rows
        logprobs = (raw if rows is None else raw[rows]).log_softmax(dim=-1)
        sampled_ids = token_ids if rows is None else token_ids[rows]
        sampled = logprobs.gather(1, sampled_ids.unsqueeze(1))
        ranks = (logprobs > sampled).sum(dim=-1, keepdim=True) + 1
        num_top = batch.num_top_logprobs
        columns = [sampled.double(), ranks.double()]
        if num_top:
            top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
            columns += [top_ids.double(), top_logprobs.double()]
        packed = torch.zeros(batch.num_rows, 3 + 2 * num_top, dtype=torch.float64, device=raw.device)
        packed[:, 0] = token_ids
        packed[slice(None) if rows is None else rows, 1:] = torch.cat(columns, dim=1)
        host = packed.cpu().numpy()
        return SamplerOutput(
            token_ids=host[:, 0].astype(np.int64),
            logprobs=host[:, 1],
            ranks=host[:, 2].astype(np.int64),
            top_token_ids=host[:, 3 : 3 + num_top].astype(np.int64),
            top_logprobs=host[:, 3 + num_top :],
        )


def _sort_filtered(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k and top-p by a full sort: for the rare row whose candidates do not fit a window."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill((before >= top_p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
