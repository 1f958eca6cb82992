"""A draft model proposing tokens for the target to verify.

**Its KV cache shares the target's blocks.** The draft model keeps its own per-layer cache
tensors, indexed by the same block ids and slots as the target's: one block id holds both
models' keys and values for the same tokens, and the KV budget is split by their bytes per
token (`pagedrs.memory.kv_bytes_per_token` of each). So the core allocates, forks, copies-on-write, preempts,
frees and prefix-caches once for both; nothing new to keep consistent.

That needs one invariant: **the draft's KV is valid wherever the target's is.** Each step the
draft model runs first:

1. *catch-up*: the step's batch without its proposals (every prefill chunk, every plain decode,
   each speculating sequence's known token at position ``P``), with the block copies. Its
   logits at ``P`` give each speculating sequence its first proposal ``d1``.
2. *propose*: for ``j = 1..s``, one token per speculating sequence: ``d_j`` at ``P + j``. Its
   logits give ``d_{j+1}``; the last pass only writes ``d_s``'s KV.

The core allocated slots ``P..P+s`` for the step, so every write lands in the sequence's own
blocks. After verification the target keeps its KV up to ``P + a`` (``a`` proposals accepted);
the draft wrote ``P`` and ``d_1..d_a`` at exactly those positions, with the same tokens. Rejected
positions are overwritten by whichever step computes them next, in both caches.

Proposals are drawn under each request's own sampling rules (temperature, top-k, top-p,
min-p; the argmax for greedy requests), and ``q``, the distribution each was drawn from, is
kept for the rejection rule (`pagedrs.spec_decode.verify`).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedrs._core import SchedulerOutput
from pagedrs.engine.model_runner import ModelRunner
from pagedrs.engine.step_arrays import StepArrays
from pagedrs.sample import Sampler, SamplingRow
from pagedrs.spec_decode.verify import draw, filtered_probs, uniforms


class DraftModelProposer:
    """Runs the draft model's share of each step; see the module docstring."""

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler
        """The target's `Sampler` (its generator draws the unseeded proposals)."""
        self.block_size = runner.block_size

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, rows: list[SamplingRow]) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
        """Runs the draft model over the step and writes its proposals into the batch
        (``out.input_token_ids`` and ``out.logits_draft_token_ids``, in place). ``rows``: the
        `SamplingRow` of each logits row. Returns the proposals in row order (what the core's
        ``update_from_output`` takes) and ``q`` by logits row for sampled rows."""
        num_drafts = out.num_draft_tokens.astype(np.int64)
        speculating = np.flatnonzero(num_drafts)
        if not len(speculating):
            # No proposals this step: the draft model still computes the step's KV (one
            # logits row is read: the model's kernels are not written for none).
            self.runner.forward(StepArrays.of(out)._replace(logits_rows=np.zeros(1, np.int64)))
            return np.zeros(0, np.int64), {}
        query_start = out.query_start_loc.astype(np.int64)
        ends = query_start[1:]
        # Logits rows of each speculating sequence: its proposals' rows, then the bonus row.
        first_logits_row = np.searchsorted(out.logits_request_indices, speculating)
        seq_rows = [rows[row] for row in first_logits_row]

        catch_up = self._catch_up_arrays(out, num_drafts, speculating)
        logits = self.runner.forward(catch_up)
        base_positions = out.positions[ends[speculating] - num_drafts[speculating] - 1].astype(np.int64)
        drafts = np.zeros((len(speculating), int(num_drafts.max())), dtype=np.int64)
        probs: dict[int, torch.Tensor] = {}
        active = np.arange(len(speculating))
        for step in range(int(num_drafts.max())):
            tokens, step_probs = self._draw(logits, [seq_rows[i] for i in active])
            drafts[active, step] = tokens
            for i, q in zip(active.tolist(), step_probs):
                if q is not None:
                    probs[int(first_logits_row[i]) + step] = q
            active = active[num_drafts[speculating[active]] > step + 1]
            writers = np.arange(len(speculating))[num_drafts[speculating] >= step + 1]
            # Every sequence still speculating writes its proposal's KV; those that need
            # another proposal also read logits.
            logits = self.runner.forward(
                self._single_token_arrays(
                    out,
                    speculating[writers],
                    base_positions[writers] + step + 1,
                    drafts[writers, step],
                    np.isin(writers, active),
                )
            )
        flat = []
        for i, seq in enumerate(speculating.tolist()):
            count = int(num_drafts[seq])
            seq_drafts = drafts[i, :count]
            out.input_token_ids[ends[seq] - count : ends[seq]] = seq_drafts
            out.logits_draft_token_ids[first_logits_row[i] : first_logits_row[i] + count] = seq_drafts
            flat.append(seq_drafts)
        return np.concatenate(flat), probs

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One proposal per row: the argmax for greedy requests, else a draw from the request's
        filtered distribution, which is returned as ``q``."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        q: list[torch.Tensor | None] = [None] * len(rows)
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            probs = filtered_probs(logits[index], [rows[i].params for i in sampled])
            tokens[index] = draw(probs, uniforms(self.sampler, [rows[i] for i in sampled], 1)[:, 0])
            for j, i in enumerate(sampled):
                q[i] = probs[j]
        return tokens.tolist(), q

    @staticmethod
    def _catch_up_arrays(out: SchedulerOutput, num_drafts: np.ndarray, speculating: np.ndarray) -> StepArrays:
        """The step without its proposals; logits rows at each speculating sequence's token."""
        num_tokens = np.diff(out.query_start_loc.astype(np.int64))
        keep = np.ones(len(out.input_token_ids), dtype=bool)
        for seq in speculating.tolist():
            end = int(out.query_start_loc[seq + 1])
            keep[end - int(num_drafts[seq]) : end] = False
        query_start = np.zeros(len(num_tokens) + 1, dtype=np.int32)
        np.cumsum(num_tokens - num_drafts, out=query_start[1:])
        return StepArrays(
            out.input_token_ids[keep],
            out.positions[keep],
            out.slot_mapping[:, keep],
            query_start,
            (out.context_lens - num_drafts).astype(np.int32),
            out.prompt_lens,
            out.block_tables,
            (query_start[speculating + 1] - 1).astype(np.int64),
            out.block_copies,
        )

    def _single_token_arrays(
        self,
        out: SchedulerOutput,
        seqs: np.ndarray,
        positions: np.ndarray,
        tokens: np.ndarray,
        wants_logits: np.ndarray,
    ) -> StepArrays:
        """One token per sequence ``seqs`` at ``positions``, in the step's slots (of KV layer
        group 0, the full-attention group, where the draft model's layers all live)."""
        block_tables = out.block_tables[:1, seqs]
        blocks = block_tables[0, np.arange(len(seqs)), positions // self.block_size].astype(np.int64)
        return StepArrays(
            tokens.astype(np.int64),
            positions.astype(np.int64),
            (blocks * self.block_size + positions % self.block_size)[None],
            np.arange(len(seqs) + 1, dtype=np.int32),
            (positions + 1).astype(np.int32),
            out.prompt_lens[seqs],
            block_tables,
            # The last pass only writes KV; it still reads one row (see `propose`).
            np.flatnonzero(wants_logits).astype(np.int64) if wants_logits.any() else np.zeros(1, np.int64),
            np.zeros((0, 2), dtype=np.int64),
        )
