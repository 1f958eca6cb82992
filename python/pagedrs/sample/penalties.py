"""Repetition, presence and frequency penalties as device state per running choice, updated
with each sampled token: the sampler applies them at the tokens a choice has seen, never over
the whole vocabulary, and never rebuilds them from Python lists."""

from __future__ import annotations

import numpy as np
import torch

from pagedrs.sampling_params import SamplingParams


class PenaltyState:
    """Per choice that uses penalties, on the device, updated with each sampled token and
    never rebuilt: the additive presence/frequency penalty of every token so far (``bias``),
    and the distinct tokens it has seen (prompt and output) as a padded id list, so applying
    the penalties touches only those tokens, not the whole vocabulary.

    A slot is taken when the choice is added and freed when it ends. Every method runs under
    ``torch.inference_mode`` (its tensors are inference tensors, grown inside the sampler).
    """

    @torch.inference_mode()
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.bias = torch.zeros(0, vocab_size, device=device)
        """``-(frequency * count + presence * (count > 0))`` per token. ``float32 [slots, vocab]``"""
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        """In the prompt or generated. ``bool [slots, vocab]``"""
        self.generated = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        """Generated at least once. ``bool [slots, vocab]``"""
        self.seen_ids = torch.zeros(0, 1, dtype=torch.long, device=device)
        """The seen tokens, first ``num_seen`` of each row; the rest repeats a seen token (so
        a gather/scatter over the whole row is harmless). ``int64 [slots, capacity]``"""
        self.num_seen = torch.zeros(0, dtype=torch.long, device=device)
        self.presence = torch.zeros(0, device=device)
        self.frequency = torch.zeros(0, device=device)
        self.max_seen = np.zeros(0, dtype=np.int64)
        """Host-side upper bound of ``num_seen`` per slot (no device sync to size a gather)."""
        self._free_slots: list[int] = []

    @property
    def num_slots_in_use(self) -> int:
        return len(self.bias) - len(self._free_slots)

    @torch.inference_mode()
    def acquire(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        if not self._free_slots:
            self._grow_slots()
        slot = self._free_slots.pop()
        distinct = sorted(set(prompt_token_ids))
        self._reserve_seen(len(distinct) + 1)
        ids = torch.tensor(distinct, dtype=torch.long, device=self.device)
        self.bias[slot] = 0
        self.generated[slot] = False
        self.seen[slot] = False
        self.seen[slot, ids] = True
        self.seen_ids[slot] = distinct[0]
        self.seen_ids[slot, : len(distinct)] = ids
        self.num_seen[slot] = len(distinct)
        self.max_seen[slot] = len(distinct)
        self.presence[slot] = params.presence_penalty
        self.frequency[slot] = params.frequency_penalty
        return slot

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def _grow_slots(self) -> None:
        old = len(self.bias)
        extra = max(8, old)

        def grown(tensor: torch.Tensor) -> torch.Tensor:
            return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])

        self.bias, self.seen, self.generated = grown(self.bias), grown(self.seen), grown(self.generated)
        self.seen_ids, self.num_seen = grown(self.seen_ids), grown(self.num_seen)
        self.presence, self.frequency = grown(self.presence), grown(self.frequency)
        self.max_seen = np.concatenate([self.max_seen, np.zeros(extra, np.int64)])
        self._free_slots.extend(range(old + extra - 1, old - 1, -1))

    def _reserve_seen(self, capacity: int) -> None:
        width = self.seen_ids.shape[1]
        if capacity <= width:
            return
        new_width = max(capacity, 2 * width)
        # Pad with each row's first seen token (any seen token would do).
        padding = self.seen_ids[:, :1].expand(-1, new_width - width)
        self.seen_ids = torch.cat([self.seen_ids, padding], dim=1).contiguous()

    def apply(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        slots_host: np.ndarray,
        repetition: torch.Tensor | None,
    ) -> None:
        """Penalizes ``logits[rows]`` in place, at the seen tokens only. Repetition (Hugging
        Face's rule, over prompt and output tokens) divides positive logits by the penalty and
        multiplies the others; presence and frequency (OpenAI's rule) add ``bias``, which is
        zero except at generated tokens (all of them seen)."""
        width = int(self.max_seen[slots_host].max())
        ids = self.seen_ids[slots, :width]
        row_index = rows.unsqueeze(1)
        values = logits[row_index, ids]
        if repetition is not None:
            factor = repetition.unsqueeze(1)
            values = torch.where(values > 0, values / factor, values * factor)
        values += self.bias[slots.unsqueeze(1), ids]
        logits[row_index, ids] = values

    def record(self, slots: torch.Tensor, slots_host: np.ndarray, token_ids: torch.Tensor) -> None:
        """Adds one sampled token per slot (each slot at most once)."""
        self.max_seen[slots_host] += 1
        self._reserve_seen(int(self.max_seen[slots_host].max()) + 1)
        first = ~self.generated[slots, token_ids]
        self.bias[slots, token_ids] -= self.frequency[slots] + self.presence[slots] * first
        self.generated[slots, token_ids] = True
        new = ~self.seen[slots, token_ids]
        # NOTE: every row writes its token at its next free position; for a token already
        # seen that only overwrites padding with a seen token, so no mask (and no sync).
        self.seen_ids[slots, self.num_seen[slots]] = token_ids
        self.num_seen[slots] += new
        self.seen[slots, token_ids] = True
