"""The executor: one scheduled batch in, sampled token ids out (vLLM's executor room).

- Draft proposals (when a draft model speculates), the forward pass (one rank or many: the
  runner says), grammar masks filled on a thread while it runs, then the sampler, or the
  verifier when the batch carries proposals.
- Failures are contained and reported in `StepResult.failed`: a failed forward pass fails
  the batch's requests; a failed sampler is retried row by row so only the rows at fault fail.
  Only a tensor-parallel failure escapes (the ranks are out of step: the engine is done).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedrs._core import SchedulerOutput
from pagedrs.engine.tp_common import TensorParallelError
from pagedrs.sample import Sampler, SamplerOutput, SamplingRow
from pagedrs.spec_decode.drafter import DraftModelProposer
from pagedrs.spec_decode.verify import verify_and_sample

logger = logging.getLogger("pagedrs")


@dataclass
class SamplingInputs:
    """What the output processor knows about a batch's rows, for the sampler.

    - ``rows``: each logits row's `SamplingRow`;
    - ``banned``: ``(row, token ids)`` a row may not sample yet (``min_tokens``);
    - ``constrained``: ``(row, matcher)`` of rows under a grammar;
    - ``prompt_rows`` / ``prompt_targets`` / ``prompt_num_top``: token rows whose logits give
      prompt logprobs, the prompt token each predicts, and the most top tokens any asks for;
    - ``sampled_rows``: the core's logits rows that are sampled, when some are not (they
      belong to pooling requests), in order; ``rows``, ``banned`` and ``constrained`` number
      these; ``None``: every row is sampled;
    - ``pool_rows``: token rows whose final hidden states pooling requests read;
    - ``lora_rows``: each token row's LoRA slot (-1: none), when adapters are running.
    """

    rows: list[SamplingRow]
    banned: list[tuple[int, list[int]]]
    constrained: list[tuple[int, int]]
    prompt_rows: np.ndarray
    prompt_targets: list[int]
    prompt_num_top: int = 0
    sampled_rows: np.ndarray | None = None
    pool_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lora_rows: np.ndarray | None = None


@dataclass
class StepResult:
    """What one executed batch gives the core and the output processor."""

    token_ids: np.ndarray
    """One sampled token per logits row (0 in rows that failed)."""
    sampled: SamplerOutput | None
    """With logprobs when asked for; ``None`` when the forward pass failed."""
    draft_token_ids: np.ndarray | None
    """The draft model's proposals, one per slot the core reserved (``None``: no draft model)."""
    prompt_logprob_columns: list[list[float]] | None = None
    """Per prompt row: logprob, rank, then the top ids and their logprobs
    (`Sampler.logprob_columns`)."""
    failed: dict[str, Exception] = field(default_factory=dict)
    """Requests that failed in this step, with the error that failed them."""
    pooled: torch.Tensor | None = None
    """Float32 final hidden states of `SamplingInputs.pool_rows`, on the CPU."""
    sampled_index: np.ndarray | None = None
    """Per core logits row, its row in ``sampled`` (-1: a pooling request's row, not sampled);
    ``None``: the same row."""

    def sampled_row(self, row: int) -> int:
        """The row of ``sampled`` that holds the core's logits row ``row``."""
        return row if self.sampled_index is None else int(self.sampled_index[row])


class Executor:
    """Runs batches on a runner (`ModelRunner`, or `TensorParallelRunner` on rank 0)."""

    def __init__(
        self,
        runner: Any,
        sampler: Sampler,
        drafter: DraftModelProposer | None,
        fill_bitmask: Callable[[list[int]], np.ndarray],
        vocab_size: int,
    ):
        self.runner = runner
        self.sampler = sampler
        self.drafter = drafter
        self.vocab_size = vocab_size
        self._fill_bitmask = fill_bitmask
        # NOTE: one thread fills the next step's masks while the forward pass runs; the core
        # releases the GIL and spreads the rows over its own threads. (No thread starts until
        # the first constrained step.)
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedrs-grammar")

    def shutdown(self) -> None:
        self._mask_thread.shutdown(wait=False)

    def empty_result(self, out: SchedulerOutput) -> StepResult:
        """The result of a batch that did not run (empty, or every request failed)."""
        drafts = np.zeros(out.num_spec_tokens, np.int64) if self.drafter is not None else None
        return StepResult(np.zeros(len(out.logits_indices), np.int64), None, drafts)

    def execute(self, out: SchedulerOutput, prepare: Callable[[SchedulerOutput], SamplingInputs]) -> StepResult:
        """Runs ``out``; ``prepare`` gives its rows' sampling inputs (a failure there fails
        the batch, like one in the forward pass)."""
        if not len(out):
            return self.empty_result(out)
        masks: Future[np.ndarray] | None = None
        drafts, draft_probs = None, None
        try:
            inputs = prepare(out)
            if inputs.constrained:  # the masks are filled while the forward pass runs
                masks = self._mask_thread.submit(self._fill_bitmask, [matcher for _, matcher in inputs.constrained])
            if self.drafter is not None:  # it writes its proposals into the batch
                drafts, draft_probs = self.drafter.propose(out, inputs.rows)
            logits, prompt_logits, pooled = self.runner.execute(
                out, inputs.prompt_rows, inputs.pool_rows, inputs.sampled_rows, inputs.lora_rows
            )
            prompt_columns = self._prompt_logprobs(inputs, prompt_logits)
            pooled = None if pooled is None else pooled.cpu()
            allowed = None if masks is None else ([row for row, _ in inputs.constrained], masks.result())
        except TensorParallelError:
            raise  # the ranks are out of step: the engine cannot go on
        except Exception as error:  # the batch fails, the engine lives on
            logger.exception("step failed; failing the %d requests of its batch", len(out.request_ids))
            if masks is not None:
                wait([masks])  # the core's matchers are in use until it is done
            result = self.empty_result(out)
            result.failed = dict.fromkeys(out.request_ids, error)
            return result
        result = StepResult(np.zeros(0, np.int64), None, drafts, prompt_columns, pooled=pooled)
        if inputs.sampled_rows is not None:  # some rows are pooling requests': not sampled
            result.sampled_index = np.full(len(out.logits_indices), -1, np.int64)
            result.sampled_index[inputs.sampled_rows] = np.arange(len(inputs.sampled_rows))
            if not inputs.rows:
                result.token_ids = np.zeros(len(out.logits_indices), np.int64)
                return result
        try:
            if out.num_spec_tokens:
                draft_ids = out.logits_draft_token_ids
                sampled = verify_and_sample(
                    self.sampler, logits, inputs.rows, inputs.banned, allowed, draft_ids, draft_probs
                )
            else:
                sampled = self.sampler(logits, inputs.rows, inputs.banned, allowed)
        except Exception:  # find the rows at fault, sample the others
            logger.exception("sampling the batch failed; sampling its %d rows one at a time", len(inputs.rows))
            sampled = self._sample_rows_alone(out, logits, inputs, allowed, result.failed)
        # NOTE: a list, not numpy: five numpy calls on a few rows took ~30 us of a single-stream
        # decode step (run cold, after the step's weights streamed through the caches).
        vocab_size = self.vocab_size
        bad_rows = [row for row, token in enumerate(sampled.token_ids.tolist()) if not 0 <= token < vocab_size]
        for row in bad_rows:  # e.g. non-finite logits drawn from on a device without checks
            sampled.token_ids[row] = 0
            request_id = self._request_of_row(out, inputs, row)
            result.failed.setdefault(request_id, ValueError("the model's logits for this request are not finite"))
        result.token_ids, result.sampled = sampled.token_ids, sampled
        if inputs.sampled_rows is not None:  # one token per core row; pooling rows get 0
            result.token_ids = np.zeros(len(out.logits_indices), np.int64)
            result.token_ids[inputs.sampled_rows] = sampled.token_ids
        return result

    @staticmethod
    def _request_of_row(out: SchedulerOutput, inputs: SamplingInputs, row: int) -> str:
        """The request whose logits row is the sampler's ``row``."""
        core_row = row if inputs.sampled_rows is None else int(inputs.sampled_rows[row])
        return out.request_ids[int(out.logits_request_indices[core_row])]

    def _prompt_logprobs(self, inputs: SamplingInputs, logits: torch.Tensor | None) -> list[list[float]] | None:
        """Batched: each prompt row's target logprob, rank and top tokens, copied to the host once."""
        if not inputs.prompt_targets:
            return None
        assert logits is not None, "prompt logprob targets without their logits rows"
        targets = torch.tensor(inputs.prompt_targets, device=logits.device)
        return self.sampler.logprob_columns(logits, targets, inputs.prompt_num_top).cpu().tolist()

    def _sample_rows_alone(
        self,
        out: SchedulerOutput,
        logits: torch.Tensor,
        inputs: SamplingInputs,
        allowed: tuple[list[int], np.ndarray] | None,
        failed: dict[str, Exception],
    ) -> SamplerOutput:
        """Each row sampled on its own; a row that still fails fails its request alone.

        NOTE: penalties edit the logits in place; if the batch failed after applying them,
        the rows retried here get them a second time. This path runs only in a step that
        already failed, and it keeps every healthy request going.
        """
        banned_by_row = dict(inputs.banned)
        mask_by_row = {} if allowed is None else {row: allowed[1][i : i + 1] for i, row in enumerate(allowed[0])}
        outputs: list[SamplerOutput | None] = []
        for row, sampling in enumerate(inputs.rows):
            row_banned = [(0, banned_by_row[row])] if row in banned_by_row else []
            row_allowed = ([0], mask_by_row[row]) if row in mask_by_row else None
            try:
                outputs.append(self.sampler(logits[row : row + 1], [sampling], row_banned, row_allowed))
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                outputs.append(None)
                failed.setdefault(self._request_of_row(out, inputs, row), error)
        return SamplerOutput.of_rows(outputs)
