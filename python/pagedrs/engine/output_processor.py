"""The output processor: the Python side of every live request (vLLM's output-processor room).

- Admission (`add`): token ids, generators, penalty slots, grammar matchers and
  detokenizers are built before the core sees the request; a refusal anywhere releases them.
- Per step: the rows' sampling inputs for the executor (`sampling_inputs`), then the core's
  columns into outputs (`process`): each new token detokenized and checked against stop
  strings, logprobs recorded, finish reasons set, failures recorded.
- `forget` is the one place a request leaves: its sampler state goes with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedrs._core import FINISH_REASONS, GrammarMatchers, Scheduler, SchedulerOutput, StepUpdates
from pagedrs.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from pagedrs.engine.executor import SamplingInputs, StepResult
from pagedrs.engine.request_state import StructuredOutputStats, _Choice, _Pooling, _Request
from pagedrs.errors import DuplicateRequestError
from pagedrs.lora.adapter import LoRARequest
from pagedrs.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sample import Sampler, SamplingRow
from pagedrs.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from pagedrs.spec_decode.verify import speculates
from pagedrs.structured_vocab import token_bytes

if TYPE_CHECKING:
    from pagedrs.lora.manager import LoRAManager

logger = logging.getLogger("pagedrs")

_POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)
"""The parameters a pooling request's `_Request` carries (nothing samples with them)."""


@dataclass(frozen=True)
class Pooler:
    """What pooling requests may ask of the served model."""

    hidden_size: int
    classify: Callable[[torch.Tensor], torch.Tensor] | None
    """The classifier head (`DecoderForCausalLM.classify`), when the model has one."""
    generates: bool
    """Whether the model has a language-model head (a sequence classifier has none)."""
    num_labels: int = 0
    """The classifier head's outputs (0 without one)."""


class OutputProcessor:
    """Live requests by id, and everything that turns the core's columns into outputs."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        sampler: Sampler,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        speculative: bool,
        rope_salt: Callable[[int], str | None] | None = None,
        pooler: Pooler | None = None,
        lora: LoRAManager | None = None,
    ):
        """``rope_salt``: what a prompt of this length adds to its cache salt (the model's
        `cache_salt`: length-dependent rotary embeddings rotate its keys by its length).
        ``pooler``: what pooling requests may ask of the model (default: embeddings without
        ``dimensions``, no classifier)."""
        self.pooler = pooler or Pooler(0, None, generates=True)
        self.lora = lora
        """The adapters (`LLMEngine` built with ``enable_lora``), else ``None``."""
        self._waiting_for_slots: list[tuple[_Request, Callable[[], None]]] = []
        self.scheduler = scheduler
        self._rope_salt = rope_salt
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.speculative = speculative
        self.eos_token_id = tokenizer.eos_token_id
        self.requests: dict[str, _Request] = {}
        self._token_texts: dict[int, str] = {}
        self._decode_ids = fast_decoder(tokenizer)
        self._grammars: GrammarMatchers | None = None
        self._num_constrained_requests = 0
        self._touched: dict[str, _Request] = {}
        """Requests that got a token, finished or failed in the step being processed."""
        self._prompt_owners: list[tuple[_Request, int]] = []
        """``(request, position)`` of the step's prompt-logprob rows, in `SamplingInputs` order."""
        self._num_pooling = 0
        """Live pooling requests (a step without any skips looking for their rows)."""
        self._pool_owners: list[tuple[_Request, int, int]] = []
        """``(request, first, count)``: the step's pooled rows ``first .. first + count`` are
        the request's, in `SamplingInputs.pool_rows` order."""

    # -- admission -----------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        cache_salt: str | None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Checks and queues a request (see `LLMEngine.add_request`)."""
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already live")
        if not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("this engine was started without LoRA: create it with enable_lora=True")
            if isinstance(params, PoolingParams):
                raise ValueError("pooling requests do not run with LoRA adapters yet")
            self.lora.register(lora_request)  # reads and checks a new adapter
            # The same prompt under two adapters has different keys and values: never shared.
            adapter_salt = f"lora:{lora_request.lora_int_id}"
            cache_salt = adapter_salt if cache_salt is None else f"{cache_salt}|{adapter_salt}"
        if isinstance(params, PoolingParams):
            self._add_pooling(request_id, prompt, params, priority, cache_salt)
            return
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        if not self.pooler.generates:
            raise ValueError(
                "this model is a sequence classifier: it has no language-model head, so it scores "
                "(PoolingParams(task='classify')) and embeds, but does not generate"
            )
        if params.n > self.max_num_seqs:  # before building n choices' state
            raise ValueError(f"n must be between 1 and max_num_seqs ({self.max_num_seqs}), got {params.n}")
        text, token_ids = self._prompt_ids(prompt)
        vocab = self.vocab_size
        stop_token_ids = list(params.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        # The core refuses a prompt that leaves no room for output (its rule, stated there).
        max_tokens = params.max_tokens or max(self.max_model_len - len(token_ids), 1)
        grammar_id = None
        if params.structured_outputs is not None:
            grammar_id = self.grammars.compile(*params.structured_outputs.kind_and_spec())
        request = self._new_request(request_id, text, token_ids, params, stop_token_ids, grammar_id)
        cache_salt = self._cache_salt(cache_salt, len(token_ids))
        if lora_request is not None and len(token_ids) >= self.max_model_len:
            # What the core would say at once, said now for a request that may wait for a slot.
            self._release(request)
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) leaves no room for output (max_model_len {self.max_model_len})"
            )

        def enqueue() -> None:
            self.scheduler.add_request(
                request_id,
                token_ids,
                max_tokens=max_tokens,
                min_tokens=min(params.min_tokens, max_tokens),
                eos_token_id=self.eos_token_id,
                stop_token_ids=stop_token_ids,
                ignore_eos=params.ignore_eos,
                n=params.n,
                priority=priority,
                cache_salt=cache_salt,
                # Speculation steps aside for adapters (the draft and the n-gram tables know none).
                speculate=speculates(params) and lora_request is None,
                # Every prompt position's logits are needed: the core computes its whole prompt.
                prompt_logprobs=params.prompt_logprobs is not None,
            )

        if lora_request is not None:
            request.lora_id = lora_request.lora_int_id
            request.waiting_for_slot = not self._acquire_slot(request)
        try:
            if request.waiting_for_slot:
                self._waiting_for_slots.append((request, enqueue))
            else:
                enqueue()
        except BaseException:
            if request.lora_id is not None and self.lora is not None and not request.waiting_for_slot:
                self.lora.release(request.lora_id)  # the slot it pinned
            self._release(request)
            raise
        self.requests[request_id] = request
        self._num_constrained_requests += grammar_id is not None

    def _acquire_slot(self, request: _Request) -> bool:
        assert self.lora is not None and request.lora_id is not None
        return self.lora.acquire(request.lora_id)

    def admit_waiting(self) -> None:
        """Moves requests whose adapters now find a slot into the scheduler, in arrival order
        (one whose adapter is already in a slot may pass one still waiting)."""
        still: list[tuple[_Request, Callable[[], None]]] = []
        for request, enqueue in self._waiting_for_slots:
            if self.requests.get(request.request_id) is not request:
                continue  # aborted while it waited
            if not self._acquire_slot(request):
                still.append((request, enqueue))
                continue
            request.waiting_for_slot = False
            try:
                enqueue()
            except Exception as error:  # the core refused it: this request fails alone
                logger.exception("request %s failed on leaving the LoRA queue", request.request_id)
                assert self.lora is not None and request.lora_id is not None
                self.lora.release(request.lora_id)
                request.waiting_for_slot = True  # (never in the scheduler)
                self._fail(request.request_id, error)
        self._waiting_for_slots = still

    @property
    def num_waiting_for_slots(self) -> int:
        return len(self._waiting_for_slots)

    def waiting_adapter_ids(self) -> set[int]:
        """Adapters whose requests wait for a slot."""
        return {request.lora_id for request, _ in self._waiting_for_slots if request.lora_id is not None}

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (``None`` for token ids) and its checked token ids."""
        if isinstance(prompt, str):
            # As vLLM does for text prompts: the tokenizer adds its special tokens (e.g. BOS).
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return text, [int(t) for t in token_ids]

    def _cache_salt(self, cache_salt: str | None, prompt_len: int) -> str | None:
        """The request's salt, with what the model's rotary adds for a prompt of this length."""
        rope_salt = self._rope_salt(prompt_len) if self._rope_salt is not None else None
        if rope_salt is None:
            return cache_salt
        return rope_salt if cache_salt is None else f"{cache_salt}|{rope_salt}"

    def _add_pooling(
        self, request_id: str, prompt: str | list[int], params: PoolingParams, priority: int, cache_salt: str | None
    ) -> None:
        """Queues a pooling request: to the core, a one-token request whose one logits row is
        never sampled (`sampling_inputs` leaves it out): it ends, and frees its blocks, in the
        step that computes its prompt's last token."""
        if self.speculative:
            raise ValueError("pooling requests (embeddings, scores) need an engine without speculative decoding")
        if params.task == "classify" and self.pooler.classify is None:
            raise ValueError(
                "this model has no classifier head: scores need a *ForSequenceClassification checkpoint "
                "(or hf_overrides with classifier_from_token, docs/pooling.md)"
            )
        if params.dimensions is not None and params.dimensions > self.pooler.hidden_size:
            raise ValueError(f"dimensions must be at most the model's hidden size ({self.pooler.hidden_size})")
        text, token_ids = self._prompt_ids(prompt)
        request = _Request(request_id, text, token_ids, _POOLING_SAMPLING, pooling=_Pooling(params))
        self.scheduler.add_request(
            request_id,
            token_ids,
            max_tokens=1,
            min_tokens=0,
            eos_token_id=self.eos_token_id,
            stop_token_ids=[],
            ignore_eos=True,
            n=1,
            priority=priority,
            cache_salt=self._cache_salt(cache_salt, len(token_ids)),
            speculate=False,
            # `mean` and `cls` read positions a cached prefix would skip.
            prompt_logprobs=params.reads_every_position,
        )
        self.requests[request_id] = request
        self._num_pooling += 1

    def _new_request(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        stop_token_ids: list[int],
        grammar_id: int | None,
    ) -> _Request:
        """The Python side of a request, not yet registered anywhere."""
        banned = []
        if params.min_tokens:
            banned = list(stop_token_ids)
            if not params.ignore_eos and self.eos_token_id is not None:
                banned.append(self.eos_token_id)
        request = _Request(request_id, text, token_ids, params)
        try:
            for index in range(params.n):
                generator = None
                if params.seed is not None:
                    # Each choice its own stream; torch takes seeds in [0, 2**64).
                    choice_seed = (params.seed + index * 1_000_003) % 2**64
                    generator = torch.Generator(device=self.device).manual_seed(choice_seed)
                penalty_slot = self.sampler.penalties.acquire(token_ids, params) if params.uses_penalties else None
                request.choices.append(
                    _Choice(
                        output=CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None),
                        detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
                        sampling=SamplingRow(params, generator, penalty_slot),
                        banned_token_ids=banned,
                        matcher=None if grammar_id is None else self.grammars.add(grammar_id),
                    )
                )
        except BaseException:
            self._release(request)
            raise
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        return request

    @property
    def grammars(self) -> GrammarMatchers:
        """Structured-output state in the core, built on first use (reading the vocabulary's
        bytes once): unconstrained traffic never pays for it."""
        if self._grammars is None:
            self._grammars = GrammarMatchers(token_bytes(self.tokenizer), self.eos_token_id, self.vocab_size)
        return self._grammars

    def fill_bitmask(self, matchers: list[int]) -> np.ndarray:
        """The token bitmasks of these grammar matchers (the executor calls it on its mask thread)."""
        return self.grammars.fill_bitmask(matchers)

    def structured_output_stats(self) -> StructuredOutputStats:
        grammars = self._grammars
        if grammars is None:
            return StructuredOutputStats()
        return StructuredOutputStats(
            self._num_constrained_requests,
            grammars.num_compiled,
            grammars.cache_hits,
            grammars.compile_seconds_total,
            grammars.mask_seconds_total,
            grammars.num_masks,
        )

    def forget(self, request: _Request) -> None:
        """The one place a request leaves the engine: its sampler state goes with it (and its
        hold on a LoRA slot)."""
        del self.requests[request.request_id]
        self._num_pooling -= request.pooling is not None
        if request.lora_id is not None and self.lora is not None:
            if request.waiting_for_slot:
                self._waiting_for_slots = [entry for entry in self._waiting_for_slots if entry[0] is not request]
            else:
                self.lora.release(request.lora_id)
        self._release(request)

    def _release(self, request: _Request) -> None:
        """Gives back the sampler state a request holds (penalty slots, grammar matchers)."""
        for choice in request.choices:
            if choice.matcher is not None:
                self.grammars.remove(choice.matcher)
                choice.matcher = None
            if choice.sampling.penalty_slot is not None:
                self.sampler.penalties.release(choice.sampling.penalty_slot)
                choice.sampling.penalty_slot = None

    # -- the step ------------------------------------------------------------------------------

    def sampling_inputs(self, out: SchedulerOutput) -> SamplingInputs:
        """Each logits row's `SamplingRow` (the core says whose row it is), the tokens banned
        per row for choices still short of ``min_tokens``, ``(row, matcher)`` of the
        constrained rows, and the rows whose logits give prompt logprobs."""
        request_ids = out.request_ids
        rows: list[SamplingRow] = []
        banned, constrained = [], []
        unsampled = []  # pooling requests' logits rows
        for row, (seq, index) in enumerate(
            zip(out.logits_request_indices.tolist(), out.logits_choice_indices.tolist())
        ):
            request = self.requests[request_ids[seq]]
            if request.pooling is not None:
                unsampled.append(row)
                continue
            choice = request.choices[index]
            sampled = len(rows)  # the row's number among the sampled rows
            rows.append(choice.sampling)
            if choice.matcher is not None:
                constrained.append((sampled, choice.matcher))
            if choice.banned_token_ids and len(choice.output.token_ids) < choice.sampling.params.min_tokens:
                # NOTE: a constrained output whose grammar has ended may only stop: its
                # constraint outranks min_tokens (banning EOS would leave it nothing).
                if choice.matcher is None or not self.grammars.is_finished(choice.matcher):
                    banned.append((sampled, choice.banned_token_ids))
        sampled_rows = np.delete(np.arange(len(out.logits_indices)), unsampled) if unsampled else None
        pool_rows = self._pool_rows(out) if self._num_pooling else np.zeros(0, np.int64)
        lora_rows = None
        if self.lora is not None and self.lora.num_running:
            lora = self.lora
            seq_slots = [
                -1 if (lora_id := self.requests[request_id].lora_id) is None else lora.slot(lora_id)
                for request_id in request_ids
            ]
            lora_rows = np.repeat(np.array(seq_slots, dtype=np.int64), out.num_scheduled_tokens)
        prompt_rows = self._prompt_logprob_rows(out)
        self._prompt_owners = [(request, position) for _, request, position in prompt_rows]
        return SamplingInputs(
            rows,
            banned,
            constrained,
            prompt_rows=np.array([row for row, _, _ in prompt_rows], dtype=np.int64),
            prompt_targets=[request.prompt_token_ids[position + 1] for _, request, position in prompt_rows],
            prompt_num_top=max((request.params.prompt_logprobs or 0 for _, request, _ in prompt_rows), default=0),
            sampled_rows=sampled_rows,
            pool_rows=pool_rows,
            lora_rows=lora_rows,
        )

    def _pool_rows(self, out: SchedulerOutput) -> np.ndarray:
        """The token rows whose final hidden states the step's pooling requests read (their
        owners into ``_pool_owners``): ``last``, the prompt's last token when this step
        computes it; ``cls``, its first; ``mean``, every position not read before."""
        rows: list[np.ndarray] = []
        owners = []
        first = 0
        for seq, request_id in enumerate(out.request_ids):
            request = self.requests.get(request_id)
            if request is None or request.pooling is None:
                continue
            state = request.pooling
            start, end = int(out.query_start_loc[seq]), int(out.query_start_loc[seq + 1])
            if end == start:
                continue
            first_position, last_position = int(out.positions[start]), int(out.positions[end - 1])
            kind = state.params.pooling_type
            if kind == "last":
                wanted = [end - 1] if last_position == len(request.prompt_token_ids) - 1 else []
                picked = np.array(wanted, np.int64)
            elif kind == "cls":
                picked = np.array([start] if first_position == 0 and state.next_position == 0 else [], np.int64)
                state.next_position = max(state.next_position, last_position + 1)
            else:  # mean: a step's positions of a request are contiguous; each is read once
                skip = state.next_position - first_position
                if skip < 0:  # the core computes such a request's whole prompt (`_add_pooling`)
                    raise RuntimeError(f"pooling request {request_id}: positions before {first_position} were skipped")
                picked = np.arange(min(start + skip, end), end, dtype=np.int64)
                state.next_position = max(state.next_position, last_position + 1)
            if len(picked):
                rows.append(picked)
                owners.append((request, first, len(picked)))
                first += len(picked)
        self._pool_owners = owners
        return np.concatenate(rows) if rows else np.zeros(0, np.int64)

    def fail_requests(self, failed: dict[str, Exception]) -> None:
        """Ends each request with finish reason ``"error"`` and frees its blocks."""
        for request_id, error in failed.items():
            self._fail(request_id, error)

    def process(self, updates: StepUpdates, result: StepResult) -> list[RequestOutput]:
        """The core's columns into outputs; returns the requests that got a token, finished or
        failed this step, and forgets the finished ones."""
        self._record_prompt_logprobs(result.prompt_logprob_columns)
        self._record_pooled(result.pooled)
        self._apply(updates, result)
        touched, self._touched = self._touched, {}
        outputs = [request.to_output() for request in touched.values()]
        for request in touched.values():
            if request.finished():
                self.forget(request)
        return outputs

    def _apply(self, updates: StepUpdates, result: StepResult) -> None:
        request_ids = updates.request_ids
        # A speculating choice may get several tokens (rows) in one update; the core may have
        # finished it at a later row than the one a stop string matches in.
        finished_by_core = set()
        if self.speculative:
            finished_by_core = {
                (request_ids[row], int(updates.choice_indices[row])) for row in np.flatnonzero(updates.finish_codes)
            }
        columns = zip(
            updates.choice_indices.tolist(),
            updates.token_ids.tolist(),
            updates.logits_rows.tolist(),
            updates.finish_codes.tolist(),
            updates.num_cached_tokens.tolist(),
        )
        for request_id, (index, token, row, finish_code, num_cached_tokens) in zip(request_ids, columns):
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted since schedule
            request.num_cached_tokens = num_cached_tokens
            if request.pooling is not None:
                if finish_code:
                    self._finish_pooling(request, FINISH_REASONS[finish_code - 1])
                continue
            choice = request.choices[index]
            if choice.output.finished():
                continue  # failed in this step's execute
            try:
                if row >= 0:
                    core_finished = finish_code != 0 or (request_id, index) in finished_by_core
                    self._append(request, choice, token, result, row, core_finished=core_finished)
                if finish_code and not choice.output.finished():
                    reason = FINISH_REASONS[finish_code - 1]
                    choice.output.finish_reason = reason
                    if reason == "stop" and row >= 0 and token != self.eos_token_id:
                        choice.output.stop_reason = token
            except Exception as error:  # this request fails, the others go on
                logger.exception("request %s failed", request_id)
                self._fail(request_id, error)
                continue
            self._touched[request_id] = request

    def _fail(self, request_id: str, error: Exception) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.error = f"{type(error).__name__}: {error}"
        for choice in request.choices:
            if not choice.output.finished():
                choice.output.finish_reason = "error"
        if request.pooling is not None:
            request.pooling.finish_reason = "error"
        try:
            self.scheduler.abort_request(request_id)
        except KeyError:
            pass  # the core had already ended every choice of it
        self._touched[request_id] = request

    def _append(
        self,
        request: _Request,
        choice: _Choice,
        token: int,
        result: StepResult,
        row: int,
        core_finished: bool,
    ) -> None:
        output = choice.output
        if choice.matcher is not None:
            if not self.grammars.advance(choice.matcher, token):
                raise RuntimeError(f"token {token} was sampled against the request's output constraint")
            if token == self.eos_token_id and not core_finished and self.grammars.is_finished(choice.matcher):
                # Its constraint outranked min_tokens (`sampling_inputs`): the core, which still
                # holds EOS back, is told the choice has ended.
                choice.output.finish_reason = "stop"
                self.scheduler.finish_request(request.request_id, "stop", choice.output.index)
        output.token_ids.append(token)
        sampled = result.sampled
        if output.logprobs is not None and sampled is not None and sampled.logprobs is not None:
            logprobs, ranks, top_ids, top_logprobs = sampled.logprob_lists()
            row = result.sampled_row(row)
            output.logprobs.append(
                self._logprob_entry(
                    token, logprobs[row], ranks[row], top_ids[row], top_logprobs[row], request.params.logprobs or 0
                )
            )
            output.cumulative_logprob = (output.cumulative_logprob or 0.0) + logprobs[row]
        previous_length = len(output.text)
        output.text += choice.detokenizer.add(token)
        self._check_stop_strings(request, choice, previous_length, core_finished)

    def _check_stop_strings(
        self, request: _Request, choice: _Choice, previous_length: int, core_finished: bool
    ) -> None:
        output, params = choice.output, request.params
        if not params.stop_strings or len(output.token_ids) < params.min_tokens:
            return
        longest = max(len(stop) for stop in params.stop_strings)
        search_from = max(previous_length - longest + 1, 0)
        best = None
        for stop in params.stop_strings:
            at = output.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return
        at, stop = best
        output.text = output.text[: at + len(stop)] if params.include_stop_str_in_output else output.text[:at]
        output.finish_reason, output.stop_reason = "stop", stop
        if not core_finished:
            self.scheduler.finish_request(request.request_id, "stop", output.index)

    # -- pooling -------------------------------------------------------------------------------

    def _record_pooled(self, pooled: torch.Tensor | None) -> None:
        """The step's pooled hidden states into their requests (`_pool_rows` said whose)."""
        owners, self._pool_owners = self._pool_owners, []
        if pooled is None:
            return
        for request, first, count in owners:
            state = request.pooling
            if state is None or request.request_id not in self.requests:
                continue
            if state.params.pooling_type == "mean":
                total = pooled[first : first + count].sum(dim=0)
                state.total = total if state.total is None else state.total + total
            else:
                state.total = pooled[first].clone()

    def _finish_pooling(self, request: _Request, reason: str) -> None:
        """The core has ended a pooling request (its prompt is done, or it was cut short)."""
        state = request.pooling
        assert state is not None
        self._touched[request.request_id] = request
        if reason != "length":  # "length": the one (unsampled) token; anything else cut it short
            state.finish_reason = reason
            request.error = request.error or (
                "the prompt needs more KV cache than the engine has"
                if reason == "capacity"
                else f"the request ended before its prompt was done ({reason})"
            )
            return
        try:
            state.result = self._pooled_result(request)
        except Exception as error:  # this request fails, the others go on
            logger.exception("pooling request %s failed", request.request_id)
            self._fail(request.request_id, error)
            return
        state.finish_reason = "stop"

    def _pooled_result(self, request: _Request) -> torch.Tensor:
        """The request's embedding or scores, from the hidden states it read."""
        state = request.pooling
        assert state is not None
        params = state.params
        if state.total is None:
            raise RuntimeError("the prompt ended before its pooled position was read")
        vector = state.total / len(request.prompt_token_ids) if params.pooling_type == "mean" else state.total
        if not torch.isfinite(vector).all():
            raise ValueError("the model's hidden states are not finite (NaN or infinity)")
        if params.task == "classify":
            classify = self.pooler.classify
            assert classify is not None  # checked at admission
            logits = classify(vector.to(self.device)).cpu()
            if not params.activation:
                return logits
            return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        return F.normalize(vector, dim=-1) if params.normalize else vector

    # -- logprobs ------------------------------------------------------------------------------

    def _prompt_logprob_rows(self, out: SchedulerOutput) -> list[tuple[int, _Request, int]]:
        """``(token row, request, position)`` of every row whose logits give the
        log-probability of the next prompt token not yet recorded."""
        rows = []
        for seq, request_id in enumerate(out.request_ids):
            request = self.requests.get(request_id)
            if request is None or request.prompt_logprobs is None:
                continue
            start, end = int(out.query_start_loc[seq]), int(out.query_start_loc[seq + 1])
            # Position p predicts prompt token p + 1; a recomputed prefix is skipped.
            next_position = len(request.prompt_logprobs) - 1
            for row, position in zip(range(start, end), out.positions[start:end].tolist()):
                if position == next_position and position + 1 < len(request.prompt_token_ids):
                    rows.append((row, request, position))
                    next_position += 1
        return rows

    def _record_prompt_logprobs(self, columns: list[list[float]] | None) -> None:
        """Each prompt token's log-probability, rank and the top tokens at its position."""
        owners, self._prompt_owners = self._prompt_owners, []
        if not columns:
            return
        num_top = max(request.params.prompt_logprobs or 0 for request, _ in owners)
        for (request, position), row in zip(owners, columns):
            if request.prompt_logprobs is None or request.request_id not in self.requests:
                continue
            token = request.prompt_token_ids[position + 1]
            top_ids = [int(top_id) for top_id in row[2 : 2 + num_top]]
            request.prompt_logprobs.append(
                self._logprob_entry(
                    token, row[0], int(row[1]), top_ids, row[2 + num_top :], request.params.prompt_logprobs or 0
                )
            )

    def _logprob_entry(
        self, token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float], num_top: int
    ) -> dict[int, Logprob]:
        """The token's `Logprob`, then the ``num_top`` most likely tokens' (ranked 1, 2, ...)."""
        entry = {token: Logprob(logprob, rank, self._token_text(token))}
        for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids[:num_top], top_logprobs[:num_top]), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(top_logprob, top_rank, self._token_text(top_id))
        return entry

    def _token_text(self, token_id: int) -> str:
        """One token decoded on its own (for logprobs), remembered."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode_ids([token_id], skip_special_tokens=False)
        return text
