"""Turns a step's logits into tokens for the whole batch at once.

Per step, rows are split by what they ask for, and each group pays only for its own rules:

- **greedy** rows (``temperature == 0``): one ``argmax``;
- **top-k** rows (``top_k`` up to `MAX_TOP_K_WINDOW`): one ``topk`` over all of them, then
  temperature, top-p and min-p on the small ``[rows, k]`` tensor, and an exponential race
  (``argmax(p / q)`` with ``q ~ Exp(1)``, the Gumbel-max trick) to draw;
- **full** rows (everything else): ``e = exp((x - max) / T)`` is each token's probability
  relative to the most likely one, so min-p is a threshold on it (no sort); an inverse-CDF draw
  (one uniform per row) picks a token, and with top-p the draw is kept only if the tokens more
  likely than it hold less than ``top_p`` of the mass (else drawn again: rejection sampling, on
  average ``1 / top_p`` draws, exact). Only a row with a ``top_k`` past the window is sorted.

Unseeded rows share batched draws from the engine's generator. A seeded row draws from its own
generator, and how much it draws depends only on its own parameters and logits, so a seeded
request gives the same text alone or in any batch.

Filtering, as in Hugging Face: temperature, then top-k, then top-p on the distribution
renormalized over the top-k survivors, then min-p (relative to the most likely token, so its
place in the order does not matter).

Penalties come from device state kept per running choice (`pagedrs.sample.penalties.PenaltyState`),
updated with each step's sampled tokens and applied at the tokens a choice has seen; logprobs,
ranks and top logprobs are computed for the rows that asked, and everything the engine needs
comes back in one device-to-host copy. On CPU, full-vocabulary draws and logprob statistics run
in the fused kernels of ``cpu/sampling.cpp`` (`pagedrs.sample.cpu_ops`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedrs.inference_mode import inference_mode
from pagedrs.sample import cpu_ops
from pagedrs.sample.ops import (
    InverseCdf,
    chunked_argmax,
    chunked_top_k,
    filtered_distribution,
    row_index,
    sort_filtered,
)
from pagedrs.sample.penalties import PenaltyState
from pagedrs.sampling_params import SamplingParams

MAX_TOP_K_WINDOW = 1024
"""Largest ``top_k`` served by ``torch.topk``; a larger one sorts its row."""
MAX_REJECTION_ROUNDS = 16
"""Top-p draws per row after the first before the rare row still rejected is sorted instead."""


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
        """Candidates this row draws from by ``topk`` (its top-k); 0: the whole vocabulary."""
        top_k = self.params.top_k if 0 < self.params.top_k < vocab_size else 0
        return top_k if top_k <= MAX_TOP_K_WINDOW else 0


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
    _lists: tuple | None = field(default=None, init=False, repr=False)

    def logprob_lists(self) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
        """The logprob columns as Python lists, converted once per step (what the engine reads
        row by row)."""
        if self._lists is None:
            if self.logprobs is None or self.ranks is None or self.top_token_ids is None or self.top_logprobs is None:
                raise ValueError("no row of this step asked for logprobs")
            self._lists = (
                self.logprobs.tolist(),
                self.ranks.tolist(),
                self.top_token_ids.tolist(),
                self.top_logprobs.tolist(),
            )
        return self._lists

    @staticmethod
    def of_rows(outputs: list[SamplerOutput | None]) -> SamplerOutput:
        """One output from single-row outputs (rows sampled one at a time); a ``None`` row
        (one that failed) gets token 0 and zero logprobs."""
        token_ids = np.array([0 if out is None else int(out.token_ids[0]) for out in outputs], dtype=np.int64)
        with_logprobs = {
            row: out.logprob_lists() for row, out in enumerate(outputs) if out is not None and out.logprobs is not None
        }
        if not with_logprobs:
            return SamplerOutput(token_ids)
        num_rows, num_top = len(outputs), max(len(top_ids[0]) for _, _, top_ids, _ in with_logprobs.values())
        logprobs, ranks = np.zeros(num_rows), np.zeros(num_rows, dtype=np.int64)
        top_token_ids, top_logprobs = np.zeros((num_rows, num_top), dtype=np.int64), np.zeros((num_rows, num_top))
        for row, (row_logprobs, row_ranks, row_top_ids, row_top_logprobs) in with_logprobs.items():
            width = len(row_top_ids[0])
            logprobs[row], ranks[row] = row_logprobs[0], row_ranks[0]
            top_token_ids[row, :width], top_logprobs[row, :width] = row_top_ids[0], row_top_logprobs[0]
        return SamplerOutput(token_ids, logprobs, ranks, top_token_ids, top_logprobs)


_BLOCKED_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1) == 0
"""``[byte value, bit]``: whether that bit is clear (a little-endian int32 word's byte ``k``
holds its bits ``8k .. 8k + 7``)."""


class _Batch:
    """A step's rows, grouped, with their parameters as device vectors. Rebuilt only when the
    rows change (in steady decoding they don't)."""

    def __init__(self, rows: list[SamplingRow], vocab_size: int, device: torch.device):
        params = [row.params for row in rows]
        self.num_rows = len(rows)
        self.greedy = [i for i, p in enumerate(params) if p.is_greedy]
        self.random = [i for i, p in enumerate(params) if not p.is_greedy]
        self.random_index = row_index(self.random, device)
        self.greedy_index = row_index(self.greedy, device)
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
        self.log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in self.params], device=device
        )
        self.top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else 0 for p in self.params], device=device)
        self.top_p = torch.tensor([p.top_p for p in self.params], device=device)
        if self.windowed:
            self.windowed_index = row_index(self.windowed, device)
            self.windowed_width = [windows[j] for j in self.windowed]
            self.row_window = torch.tensor(self.windowed_width, device=device).unsqueeze(1)
            self.windowed_temperature = self.temperature[self.windowed_index]
            self.windowed_any_top_p = any(self.params[j].top_p < 1 for j in self.windowed)
            self.windowed_top_p = self.top_p[self.windowed_index].unsqueeze(1)
            self.windowed_min_p = self.log_min_p[self.windowed_index].exp().unsqueeze(1)
        self.full_index = row_index(self.full, device)
        self.full_generators = [self.generators[j] for j in self.full] if self.any_seeded else None
        self.full_temperature = self.temperature[self.full_index]
        self.full_unit_temperature = all(self.params[j].temperature == 1 for j in self.full)
        self.full_min_p = self.log_min_p[self.full_index].exp().unsqueeze(1)
        self.full_top_p_values = self.top_p[self.full_index]
        # The fused kernel's vectors ([rows], contiguous), made once for the batch.
        self.full_temperature_rows = self.full_temperature.squeeze(1).contiguous()
        self.full_min_p_rows = self.full_min_p.squeeze(1).contiguous()
        # A top-k past the window is applied by a sort (top-p with it); the other top-p rows
        # are drawn by rejection.
        self.full_sorted = [0 < self.params[j].top_k < vocab_size and windows[j] == 0 for j in self.full]
        self.full_rejection = [
            self.params[j].top_p < 1 and not is_sorted for j, is_sorted in zip(self.full, self.full_sorted)
        ]

        penalized = [i for i, row in enumerate(rows) if row.penalty_slot is not None]
        self.any_penalties = bool(penalized)
        if penalized:
            self.penalty_rows = row_index(penalized, device)
            self.penalty_slots_host = np.array([rows[i].penalty_slot for i in penalized], dtype=np.int64)
            self.penalty_slots = torch.from_numpy(self.penalty_slots_host).to(device)
            repetition = [params[i].repetition_penalty for i in penalized]
            self.repetition = torch.tensor(repetition, device=device) if any(r != 1 for r in repetition) else None

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.logprob_rows = row_index(logprob_rows, device) if logprob_rows else None
        self.all_logprobs = len(logprob_rows) == len(rows)
        self.num_top_logprobs = max((params[i].logprobs or 0 for i in logprob_rows), default=0)


class Sampler:
    """``fused``: on CPU, draw full-vocabulary rows and compute logprobs with the compiled
    kernels of ``cpu/sampling.cpp`` (one pass a row, no ``[rows, vocab]`` temporaries); ``None``
    uses them wherever they load. Same rules either way; the torch ops are the GPU path."""

    def __init__(
        self, vocab_size: int, seed: int | None = None, device: torch.device | str = "cpu", fused: bool | None = None
    ):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        if fused is None:
            fused = self.device.type == "cpu" and cpu_ops.available()
        if fused and self.device.type != "cpu":
            raise ValueError(f"the fused sampling kernels run on the CPU, not on {self.device}")
        self.fused = fused
        # Generators live on the device of the logits they sample from.
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        self.penalties = PenaltyState(vocab_size, self.device)
        self._blocked_bits: torch.Tensor | None = None  # _BLOCKED_BITS on the device, once needed
        self._last_rows: list[SamplingRow] = []
        self._last_batch: _Batch | None = None

    def _batch(self, rows: list[SamplingRow]) -> _Batch:
        if self._last_batch is None or rows != self._last_rows:
            self._last_rows, self._last_batch = list(rows), _Batch(rows, self.vocab_size, self.device)
        return self._last_batch

    @inference_mode
    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        banned: Sequence[tuple[int, list[int]]] = (),
        allowed: tuple[list[int], np.ndarray] | None = None,
    ) -> SamplerOutput:
        """``logits``: ``[R, vocab]``, one row per entry of ``rows``; penalties and bans are
        applied to them in place unless a row asks for logprobs (those need the raw values).
        ``banned``: ``(row, token ids)`` that may not be sampled now (EOS and stop tokens before
        ``min_tokens``). ``allowed``: ``(rows, bitmask)`` for constrained rows, the tokens each
        may sample as an ``int32 [len(rows), ceil(vocab / 32)]`` bitmask (bit ``j`` of word ``w``:
        token ``32 w + j``), as the core's `GrammarMatchers.fill_bitmask` writes it."""
        batch = self._batch(rows)
        # NOTE: here and below, no op where none is needed: each torch op a decode step calls
        # after the forward pass runs cold (pagedrs.inference_mode's NOTE), several microseconds.
        raw = logits if logits.dtype == torch.float32 else logits.float()
        logits = raw
        if batch.any_penalties or banned or allowed is not None:
            if batch.logprob_rows is not None:
                logits = raw.clone()  # the raw logits give the logprobs
            if batch.any_penalties:
                self.penalties.apply(
                    logits, batch.penalty_rows, batch.penalty_slots, batch.penalty_slots_host, batch.repetition
                )
            if banned:
                ban_rows = [row for row, token_ids in banned for _ in token_ids]
                ban_ids = [token for _, token_ids in banned for token in token_ids]
                logits[row_index(ban_rows, self.device), row_index(ban_ids, self.device)] = float("-inf")
            if allowed is not None:
                self._mask(logits, *allowed)
        if not batch.random:
            token_ids = self._argmax(logits)
        elif not batch.greedy:
            token_ids = self._sample(logits, batch)
        else:
            token_ids = torch.empty(len(logits), dtype=torch.long, device=logits.device)
            token_ids[batch.greedy_index] = self._argmax(logits[batch.greedy_index])
            token_ids[batch.random_index] = self._sample(logits[batch.random_index], batch)
        if batch.any_penalties:
            self.penalties.record(batch.penalty_slots, batch.penalty_slots_host, token_ids[batch.penalty_rows])
        return self._to_host(raw, token_ids, batch)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy rows' tokens: the fused kernel's (one call) on the CPU, else chunk maxima
        in torch ops."""
        if self.fused and logits.is_contiguous():
            return cpu_ops.argmax_rows(logits, check=False)  # the model's float32 rows
        return chunked_argmax(logits)

    def _mask(self, logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
        """Sets the logits of every token a constrained row may not sample to -inf."""
        if self.fused and logits.is_contiguous():
            # One pass over the words, all-allowed words skipped (~8 ms -> well under 1 ms at
            # 32 rows of 49k tokens, where the torch ops below expand every bit).
            cpu_ops.apply_token_bitmask(logits, torch.tensor(rows), torch.from_numpy(bitmask))
            return
        words = torch.from_numpy(bitmask).to(self.device, non_blocking=True).view(torch.uint8)
        if self._blocked_bits is None:
            self._blocked_bits = _BLOCKED_BITS.to(self.device)
        blocked = self._blocked_bits[words.int()].view(len(rows), -1)[:, : logits.shape[1]]
        index = row_index(rows, self.device)
        logits[index] = logits[index].masked_fill_(blocked, float("-inf"))

    def _sample(self, logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """Draws one token per row of ``logits`` (the batch's random rows)."""
        if not batch.full:
            return self._sample_windowed(logits, batch)
        if not batch.windowed:
            return self._sample_full(logits, batch)
        token_ids = torch.empty(len(logits), dtype=torch.long, device=logits.device)
        token_ids[batch.windowed_index] = self._sample_windowed(logits[batch.windowed_index], batch)
        token_ids[batch.full_index] = self._sample_full(logits[batch.full_index], batch)
        return token_ids

    def _sample_windowed(self, logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """Rows with a top-k: candidates are their ``k`` most likely tokens."""
        values, token_ids = chunked_top_k(logits, batch.window)  # most likely first
        values = values / batch.windowed_temperature  # a positive scale keeps the order
        ranks = torch.arange(batch.window, device=logits.device).unsqueeze(0)
        keep = ranks < batch.row_window
        # Probabilities relative to the most likely token; masked ones are 0.
        relative = (values - values[:, :1]).exp_().masked_fill_(~keep, 0.0)
        if batch.windowed_any_top_p:
            probs = relative / relative.sum(dim=-1, keepdim=True)
            before = probs.cumsum(dim=-1) - probs
            keep &= ~((before >= batch.windowed_top_p) & (ranks > 0))
        if batch.any_min_p:
            keep &= relative >= batch.windowed_min_p
        race = torch.empty_like(values).exponential_(generator=self.generator)
        if batch.any_seeded:
            # A seeded row draws its own k, whatever the batch's widest window is.
            for row, position in enumerate(batch.windowed):
                generator = batch.generators[position]
                if generator is not None:
                    race[row, : batch.windowed_width[row]].exponential_(generator=generator)
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        chosen = relative.masked_fill_(~keep, 0.0).div_(race).argmax(dim=-1)
        return token_ids.gather(1, chosen.unsqueeze(1)).squeeze(1)

    def _sample_full(self, logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """Rows drawn over the whole vocabulary by inverse CDF, with top-p by rejection (the
        fused CPU kernel, or torch ops elsewhere)."""
        temperature, top_p = batch.full_temperature, batch.full_top_p_values
        sorted_rows = [row for row, is_sorted in enumerate(batch.full_sorted) if is_sorted]
        if sorted_rows:
            # A top-k past the window (rare): top-k and top-p by a full sort, up front.
            rows = row_index(sorted_rows, logits.device)
            positions = batch.full_index[rows]
            logits = logits.clone()
            logits[rows] = (
                sort_filtered(logits[rows] / temperature[rows], batch.top_k[positions], batch.top_p[positions])
                * temperature[rows]
            )
            top_p = top_p.clone()
            top_p[rows] = 1.0  # applied by the sort
        generators = batch.full_generators
        if self.fused:
            uniforms = self.uniforms(range(len(logits)), generators, 1 + MAX_REJECTION_ROUNDS)
            # (unchecked in Python: the model's rows, vectors of validated SamplingParams)
            token_ids = cpu_ops.sample_from_rows(
                logits, batch.full_temperature_rows, batch.full_min_p_rows, top_p, uniforms, check=False
            )
            pending = [row for row, token in enumerate(token_ids.tolist()) if token < 0]  # (a list: cold numpy costs)
        else:
            token_ids, pending = self._draw_full_with_torch(logits, batch, top_p, generators)
        if pending:
            # Still rejected after every round (a tiny top_p over a flat distribution): sort.
            rows = row_index(pending, logits.device)
            positions = batch.full_index[rows]
            probs = filtered_distribution(
                logits[rows], temperature[rows], batch.top_k[positions], batch.top_p[positions], batch.full_min_p[rows]
            )
            token_ids[rows] = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return token_ids

    def _draw_full_with_torch(
        self, logits: torch.Tensor, batch: _Batch, top_p: torch.Tensor, generators
    ) -> tuple[torch.Tensor, list[int]]:
        """`_sample_full`'s draws in torch ops; returns the tokens and the rows every round
        rejected."""
        # Each token's probability relative to the row's most likely one.
        relative = logits - logits.amax(dim=-1, keepdim=True)
        if not batch.full_unit_temperature:
            relative.div_(batch.full_temperature)
        relative.exp_()
        candidates = relative
        if batch.any_min_p:
            candidates = relative.masked_fill(relative < batch.full_min_p, 0.0)
        sampler = InverseCdf(candidates)
        token_ids = sampler.draw(self.uniforms(range(len(candidates)), generators))
        pending = [row for row, by_rejection in enumerate(batch.full_rejection) if by_rejection]
        for _ in range(MAX_REJECTION_ROUNDS):
            if not pending:
                break
            rows = None if len(pending) == len(relative) else row_index(pending, logits.device)
            # NOTE: the draw is in the nucleus iff the tokens strictly more likely than it hold
            # less than top_p of the mass; a rejected row draws again (rejection sampling).
            row_relative = relative if rows is None else relative[rows]
            drawn = row_relative.gather(1, (token_ids if rows is None else token_ids[rows]).unsqueeze(1))
            before = torch.where(row_relative > drawn, row_relative, 0.0).sum(dim=-1)
            row_top_p = top_p if rows is None else top_p[rows]
            rejected = (before >= row_top_p * row_relative.sum(dim=-1)).tolist()
            pending = [row for row, reject in zip(pending, rejected) if reject]
            if pending:
                token_ids[row_index(pending, logits.device)] = sampler.draw(self.uniforms(pending, generators), pending)
        return token_ids, pending

    def uniforms(
        self, rows, generators: list[torch.Generator | None] | None, per_row: int | None = None
    ) -> torch.Tensor:
        """``U(0, 1)`` draws for each row (one, or ``[rows, per_row]``): the engine's
        generator, or the row's own when seeded (so its draws never depend on the batch)."""
        rows = list(rows)
        shape = (len(rows),) if per_row is None else (len(rows), per_row)
        uniform = torch.rand(shape, device=self.device, generator=self.generator)
        if generators is None:
            return uniform
        for i, row in enumerate(rows):
            generator = generators[row]
            if generator is not None:
                draws = torch.rand(per_row or 1, device=self.device, generator=generator)
                uniform[i] = draws if per_row is not None else draws[0]
        return uniform

    @inference_mode
    def logprob_columns(self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> torch.Tensor:
        """Per row of ``logits`` (``[N, vocab]``): the log-probability of ``token_ids`` under the
        raw distribution, its rank (1 = most likely), then the ``num_top`` most likely token ids
        and their log-probabilities, as ``float64 [N, 2 + 2 * num_top]`` on the logits' device."""
        logits = logits.float().contiguous()
        if self.fused:
            logprobs, ranks, top_ids, top_logprobs = cpu_ops.logprob_stats(logits, token_ids, num_top)
            columns = [logprobs.unsqueeze(1), ranks.unsqueeze(1), top_ids, top_logprobs]
        else:
            # Log-probabilities are logits minus the row's logsumexp: ranks and the top tokens
            # come from the logits themselves, so no [rows, vocab] log-softmax is written.
            normalizer = logits.logsumexp(dim=-1, keepdim=True)
            sampled_logits = logits.gather(1, token_ids.unsqueeze(1))
            ranks = (logits > sampled_logits).sum(dim=-1, keepdim=True) + 1
            top_logits, top_ids = logits.topk(num_top, dim=-1)
            columns = [sampled_logits - normalizer, ranks, top_ids, top_logits - normalizer]
        return torch.cat([column.double() for column in columns], dim=1)

    def _to_host(self, raw: torch.Tensor, token_ids: torch.Tensor, batch: _Batch) -> SamplerOutput:
        """Logprobs of the rows that asked, and one device-to-host copy of everything."""
        if batch.logprob_rows is None:
            return SamplerOutput((token_ids if self.fused else token_ids.cpu()).numpy())
        rows = None if batch.all_logprobs else batch.logprob_rows
        num_top = batch.num_top_logprobs
        columns = self.logprob_columns(
            raw if rows is None else raw[rows], token_ids if rows is None else token_ids[rows], num_top
        )
        packed = torch.zeros(batch.num_rows, 3 + 2 * num_top, dtype=torch.float64, device=raw.device)
        packed[:, 0] = token_ids
        packed[slice(None) if rows is None else rows, 1:] = columns
        host = packed.cpu().numpy()
        return SamplerOutput(
            token_ids=host[:, 0].astype(np.int64),
            logprobs=host[:, 1],
            ranks=host[:, 2].astype(np.int64),
            top_token_ids=host[:, 3 : 3 + num_top].astype(np.int64),
            top_logprobs=host[:, 3 + num_top :],
        )
