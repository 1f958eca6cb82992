"""`LLMEngine`: one step = schedule (Rust) -> execute (forward pass and sampler: arrays in,
sampled arrays out) -> update_from_output (Rust, columns out) -> apply (detokenize, stop
strings, logprobs, outputs)."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedrs._core import FINISH_REASONS, GrammarMatchers, Scheduler, SchedulerOutput, StepUpdates
from pagedrs.config import EngineConfig, resolve_dtype
from pagedrs.engine.cuda_graphs import GraphSettings
from pagedrs.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from pagedrs.engine.host_memory import retain_freed_host_memory
from pagedrs.engine.model_runner import load_model_runner
from pagedrs.engine.parallel import TensorParallelError, TensorParallelGroup, check_parallel_config, launched_setup
from pagedrs.errors import DuplicateRequestError
from pagedrs.layers.linear import TensorParallel
from pagedrs.memory import kv_cache_capacity
from pagedrs.models import architecture_of, build_model
from pagedrs.models.loader import load_config, load_tokenizer, resolve_model
from pagedrs.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrs.quant.loading import predicted_weight_bytes
from pagedrs.sample import Sampler, SamplerOutput, SamplingRow
from pagedrs.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from pagedrs.spec_decode import DraftModelProposer, SpeculativeConfig, speculates, verify_and_sample
from pagedrs.structured_vocab import token_bytes

logger = logging.getLogger("pagedrs")


@dataclass(frozen=True)
class StructuredOutputStats:
    """Counters of structured outputs, as the engine thread publishes them (the core's
    `GrammarMatchers` may only be read between steps)."""

    num_requests: int = 0
    """Constrained requests admitted."""
    num_compiled: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    mask_seconds: float = 0.0
    """Wall time of filling token masks (it overlaps the forward pass)."""
    num_masks: int = 0
    """Rows masked."""


@dataclass
class _Choice:
    """Python-side state of one choice of a request."""

    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    sampling: SamplingRow
    """Its parameters, seeded generator and penalty slot, as the sampler takes them."""
    banned_token_ids: list[int]
    """Tokens it may not sample while it has fewer than ``min_tokens`` (EOS, stop tokens)."""
    matcher: int | None = None
    """Its structured-output state in the core's `GrammarMatchers`, when constrained."""


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (the core's count, set once scheduled)."""
    error: str | None = None

    def finished(self) -> bool:
        return all(choice.output.finished() for choice in self.choices)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[choice.output for choice in self.choices],
            finished=self.finished(),
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )


def wants_decode_graphs(config: EngineConfig, device: torch.device, parallel: object) -> bool:
    """CUDA graphs for decode: on a GPU, one rank, unless ``enforce_eager``."""
    return device.type == "cuda" and parallel is None and not config.enforce_eager


class LLMEngine:
    """The offline engine. Not thread-safe: one caller steps it."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any):
        config = config or EngineConfig(**kwargs)
        self.config = config
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        retain_freed_host_memory()
        source = resolve_model(config.model)
        self.model_name = source.name
        self.hf_config = load_config(source)
        self.architecture = architecture_of(self.hf_config)
        self.tokenizer = load_tokenizer(source)
        check_parallel_config(config, self.device)
        tp_size = config.tensor_parallel_size
        if tp_size > 1:
            with torch.device("meta"):  # an indivisible head count fails here, before any rank starts
                build_model(self.hf_config, self.dtype, TensorParallel(0, tp_size))
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        self.draft_hf_config = self._draft_config(self.speculative, tp_size)
        kv_cache_bytes = config.kv_cache_bytes(
            self.device, self._weight_bytes(source) if config.kv_cache_memory is None else 0
        )
        # A draft model's KV lives in the same blocks (`pagedrs.spec_decode.drafter`).
        capacity = kv_cache_capacity(
            self.hf_config, kv_cache_bytes, self.dtype, config.block_size, tp_size, self.draft_hf_config
        )
        if capacity.num_blocks < 1:
            raise ValueError(f"kv_cache_memory is too small for one block of {capacity.bytes_per_block} bytes")
        model_max_len = int(getattr(self.hf_config, "max_position_embeddings", 0) or 2**31)
        self.max_model_len = min(config.max_model_len or model_max_len, model_max_len)
        draft_max_len = getattr(self.draft_hf_config, "max_position_embeddings", None)
        if draft_max_len is not None and draft_max_len < self.max_model_len:
            logger.warning(
                "the draft model was trained on %d positions, fewer than max_model_len %d: past them its "
                "proposals may be poor (the output stays exact)",
                draft_max_len,
                self.max_model_len,
            )
        self.scheduler = Scheduler(
            capacity.num_blocks,
            config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            enable_prefix_caching=config.enable_prefix_caching,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_num_partial_prefills=config.max_num_partial_prefills,
            namespace=f"{self.model_name}|{self.dtype}",
            **(self.speculative.scheduler_kwargs(self.device.type) if self.speculative is not None else {}),
        )
        self.parallel: TensorParallelGroup | None = None
        """The other tensor-parallel ranks (this engine is rank 0), when there are any."""
        # NOTE: an explicit backend with one rank also goes through torch.distributed (the GPU
        # check proves the NCCL path initializes on one device this way).
        if tp_size > 1 or config.distributed_backend is not None or launched_setup(config, self.device) is not None:
            self.parallel = TensorParallelGroup(config, self.device, capacity.num_blocks, self.dtype)
        try:
            self.runner = load_model_runner(
                config,
                self.dtype,
                self.device,
                capacity.num_blocks,
                size=tp_size,
                hf_config=self.hf_config,
                graphs=GraphSettings(self.max_model_len, config.max_num_seqs)
                if wants_decode_graphs(config, self.device, self.parallel)
                else None,
            )
            if self.parallel is not None:
                self.parallel.wait_until_loaded()
                self.runner.parallel = self.parallel
        except BaseException:
            if self.parallel is not None:
                self.parallel.shutdown(graceful=False)
            raise
        self.model = self.runner.model
        self.sampler = Sampler(self.hf_config.vocab_size, config.seed, self.device)
        self.drafter: DraftModelProposer | None = None
        if self.speculative is not None and self.speculative.model is not None:
            draft_runner = load_model_runner(
                dataclasses.replace(config, model=self.speculative.model),
                self.dtype,
                self.device,
                capacity.num_blocks,
                hf_config=self.draft_hf_config,
            )
            self.drafter = DraftModelProposer(draft_runner, self.sampler)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._requests: dict[str, _Request] = {}
        self._token_texts: dict[int, str] = {}
        self._decode_ids = fast_decoder(self.tokenizer)
        self._grammars: GrammarMatchers | None = None
        # NOTE: one thread fills the next step's masks while the forward pass runs; the core
        # releases the GIL and spreads the rows over its own threads. (No thread starts until
        # the first constrained step.)
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedrs-grammar")
        self._num_constrained_requests = 0
        self._step_drafts: np.ndarray | None = None
        """The draft model's proposals of the step being run, for the core."""
        self.last_schedule: SchedulerOutput | None = None
        """The last step's batch (`SchedulerOutput`), for metrics and benchmarks."""
        if self.speculative is not None:
            logger.info("speculative decoding: %s", self.speculative)
        logger.info(
            "pagedrs engine: %s (%s) %s on %s, tensor parallel %d%s, %d KV blocks of %d tokens (%d tokens)",
            self.model_name,
            self.architecture,
            self.dtype,
            self.device,
            tp_size,
            f" ({self.parallel.backend})" if self.parallel is not None else "",
            capacity.num_blocks,
            config.block_size,
            capacity.num_tokens,
        )

    def _weight_bytes(self, source: Any) -> int:
        """The weights of the model (and of a draft model), predicted from the checkpoints, for
        the default KV budget."""
        config = self.config
        total = predicted_weight_bytes(source, config.quantization, self.dtype, self.device)
        if self.speculative is not None and self.speculative.model is not None:
            draft = resolve_model(self.speculative.model)
            total += predicted_weight_bytes(draft, config.quantization, self.dtype, self.device)
        return total

    def _draft_config(self, speculative: SpeculativeConfig | None, tp_size: int) -> Any:
        """The draft model's Hugging Face config, checked against the target's; ``None`` without
        a draft model."""
        if speculative is None or speculative.model is None:
            return None
        if tp_size > 1:
            raise ValueError(
                "a draft model runs with tensor_parallel_size 1 (ngram and suffix speculation run with any)"
            )
        draft_config = load_config(resolve_model(speculative.model))
        architecture_of(draft_config)  # an unsupported draft architecture fails here
        if draft_config.vocab_size != self.hf_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_config.vocab_size} tokens) differs from the target's "
                f"({self.hf_config.vocab_size}): it must share the target's tokenizer"
            )
        return draft_config

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request. Bad input raises ``ValueError`` and queues nothing.

        Admission is atomic: everything the request needs (token ids, generators, penalty
        slots, detokenizers) is checked and built before the core sees it, and if the core
        refuses it, what was built is released. A refused request leaves no trace.
        """
        params = params or SamplingParams()
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already live")
        if not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        if params.n > self.config.max_num_seqs:  # before building n choices' state
            raise ValueError(f"n must be between 1 and max_num_seqs ({self.config.max_num_seqs}), got {params.n}")
        if isinstance(prompt, str):
            # As vLLM does for text prompts: the tokenizer adds its special tokens (e.g. BOS).
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        stop_token_ids = list(params.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        # The core refuses a prompt that leaves no room for output (its rule, stated there).
        max_tokens = params.max_tokens or max(self.max_model_len - len(token_ids), 1)
        if params.prompt_logprobs is not None:
            # NOTE: every prompt position's logits are needed, so this request must compute
            # its whole prompt: a salt of its own keeps it off everyone's cached blocks.
            cache_salt = f"{cache_salt or ''}|prompt-logprobs|{request_id}|{time.monotonic_ns()}"
        grammar_id = None
        if params.structured_outputs is not None:
            grammar_id = self.grammars.compile(*params.structured_outputs.kind_and_spec())
        request = self._new_request(request_id, text, token_ids, params, stop_token_ids, grammar_id)
        try:
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
                speculate=speculates(params),
            )
        except BaseException:
            self._release(request)
            raise
        self._requests[request_id] = request
        self._num_constrained_requests += grammar_id is not None

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
        request = _Request(request_id, text, token_ids, params, [])
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
            self._grammars = GrammarMatchers(token_bytes(self.tokenizer), self.eos_token_id, self.hf_config.vocab_size)
        return self._grammars

    def structured_output_stats(self) -> StructuredOutputStats:
        """Call between steps (from the thread that steps the engine)."""
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

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its blocks; unknown ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        self._forget(request)
        self.scheduler.abort_request(request_id)

    def _forget(self, request: _Request) -> None:
        """The one place a request leaves the engine: its sampler state goes with it."""
        del self._requests[request.request_id]
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

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def check_health(self) -> None:
        """Raises `TensorParallelError` once a tensor-parallel rank has failed (the engine
        cannot step again); returns otherwise."""
        if self.parallel is not None:
            self.parallel.check()

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks and the mask thread. Idempotent; the engine
        cannot step afterwards."""
        if self.parallel is not None:
            self.parallel.shutdown()
        self._mask_thread.shutdown(wait=False)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the requests that got a token or finished.

        A failure fails only the requests it touches: an exception while handling one
        request's token ends that request (finish reason ``"error"``); one in the forward
        pass or the sampler ends the requests of that batch. Either way their blocks are
        freed and the engine goes on with the others.
        """
        self.check_health()
        out = self.scheduler.schedule()
        self.last_schedule = out
        touched: dict[str, _Request] = {}
        self._step_drafts = None
        sampled = self._execute(out, touched) if len(out) else None
        token_ids = sampled.token_ids if sampled is not None else np.zeros(len(out.logits_indices), np.int64)
        if self.drafter is not None and self._step_drafts is None:
            # The step failed before the draft model proposed: its requests have failed, and
            # the core drops their rows; it still expects one proposal per reserved slot.
            self._step_drafts = np.zeros(out.num_spec_tokens, np.int64)
        self._apply(self.scheduler.update_from_output(token_ids, self._step_drafts), sampled, touched)
        outputs = [request.to_output() for request in touched.values()]
        for request in touched.values():
            if request.finished():
                self._forget(request)
        return outputs

    def _execute(self, out: SchedulerOutput, touched: dict[str, _Request]) -> SamplerOutput | None:
        """Arrays in, sampled arrays out: the forward pass and the sampler. If the forward
        pass fails, every request of the batch fails (and ``None`` is returned); if the
        sampler fails, the rows are sampled one at a time and only the rows that fail alone
        fail their requests."""
        masks: Future[np.ndarray] | None = None
        try:
            rows, banned, constrained = self._sampling_rows(out)
            if constrained:  # the masks are filled while the forward pass runs
                masks = self._fill_masks([matcher for _, matcher in constrained])
            prompt_rows = self._prompt_logprob_rows(out)
            extra_rows = np.array([row for row, _, _ in prompt_rows], dtype=np.int64)
            draft_probs = None
            if self.drafter is not None:  # it writes its proposals into the batch
                self._step_drafts, draft_probs = self.drafter.propose(out, rows)
            logits, prompt_logits = self.runner.execute(out, extra_rows)
            self._record_prompt_logprobs(prompt_rows, prompt_logits)
            allowed = None if masks is None else ([row for row, _ in constrained], masks.result())
        except TensorParallelError:
            raise  # the ranks are out of step: the engine cannot go on
        except Exception as error:  # the batch fails, the engine lives on
            logger.exception("step failed; failing the %d requests of its batch", len(out.request_ids))
            if masks is not None:
                wait([masks])  # the core's matchers are in use until it is done
            for request_id in set(out.request_ids):
                self._fail(request_id, error, touched)
            return None
        try:
            if out.num_spec_tokens:
                draft_ids = out.logits_draft_token_ids
                sampled = verify_and_sample(self.sampler, logits, rows, banned, allowed, draft_ids, draft_probs)
            else:
                sampled = self.sampler(logits, rows, banned, allowed)
        except Exception:  # find the rows at fault, sample the others
            logger.exception("sampling the batch failed; sampling its %d rows one at a time", len(rows))
            sampled = self._sample_rows_alone(out, logits, rows, banned, allowed, touched)
        bad_rows = np.flatnonzero((sampled.token_ids < 0) | (sampled.token_ids >= self.hf_config.vocab_size))
        for row in bad_rows.tolist():  # e.g. non-finite logits drawn from on a device without checks
            sampled.token_ids[row] = 0
            request_id = out.request_ids[int(out.logits_request_indices[row])]
            self._fail(request_id, ValueError("the model's logits for this request are not finite"), touched)
        return sampled

    def _sample_rows_alone(
        self,
        out: SchedulerOutput,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        banned: list[tuple[int, list[int]]],
        allowed: tuple[list[int], np.ndarray] | None,
        touched: dict[str, _Request],
    ) -> SamplerOutput:
        """Each row sampled on its own; a row that still fails fails its request alone.

        NOTE: penalties edit the logits in place; if the batch failed after applying them,
        the rows retried here get them a second time. This path runs only in a step that
        already failed, and it keeps every healthy request going.
        """
        banned_by_row = dict(banned)
        mask_by_row = {} if allowed is None else {row: allowed[1][i : i + 1] for i, row in enumerate(allowed[0])}
        outputs: list[SamplerOutput | None] = []
        for row, sampling in enumerate(rows):
            row_banned = [(0, banned_by_row[row])] if row in banned_by_row else []
            row_allowed = ([0], mask_by_row[row]) if row in mask_by_row else None
            try:
                outputs.append(self.sampler(logits[row : row + 1], [sampling], row_banned, row_allowed))
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                outputs.append(None)
                request_id = out.request_ids[int(out.logits_request_indices[row])]
                self._fail(request_id, error, touched)
        return SamplerOutput.of_rows(outputs)

    def _apply(self, updates: StepUpdates, sampled: SamplerOutput | None, touched: dict[str, _Request]) -> None:
        """The core's columns into outputs: each new token detokenized and checked against
        stop strings, logprobs recorded, finish reasons set."""
        request_ids = updates.request_ids
        # A speculating choice may get several tokens (rows) in one update; the core may have
        # finished it at a later row than the one a stop string matches in.
        finished_by_core = set()
        if self.speculative is not None:
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
            request = self._requests.get(request_id)
            if request is None:
                continue  # aborted since schedule
            request.num_cached_tokens = num_cached_tokens
            choice = request.choices[index]
            if choice.output.finished():
                continue  # failed in this step's execute
            try:
                if row >= 0:
                    core_finished = finish_code != 0 or (request_id, index) in finished_by_core
                    self._append(request, choice, token, sampled, row, core_finished=core_finished)
                if finish_code and not choice.output.finished():
                    reason = FINISH_REASONS[finish_code - 1]
                    choice.output.finish_reason = reason
                    if reason == "stop" and row >= 0 and token != self.eos_token_id:
                        choice.output.stop_reason = token
            except Exception as error:  # this request fails, the others go on
                logger.exception("request %s failed", request_id)
                self._fail(request_id, error, touched)
                continue
            touched[request_id] = request

    def _fail(self, request_id: str, error: Exception, touched: dict[str, _Request]) -> None:
        """Ends a request with finish reason ``"error"`` and frees its blocks."""
        request = self._requests.get(request_id)
        if request is None:
            return
        request.error = f"{type(error).__name__}: {error}"
        for choice in request.choices:
            if not choice.output.finished():
                choice.output.finish_reason = "error"
        try:
            self.scheduler.abort_request(request_id)
        except KeyError:
            pass  # the core had already ended every choice of it
        touched[request_id] = request

    def _prompt_logprob_rows(self, out) -> list[tuple[int, _Request, int]]:
        """``(token row, request, position)`` of every row whose logits give the
        log-probability of the next prompt token not yet recorded."""
        rows = []
        for seq, request_id in enumerate(out.request_ids):
            request = self._requests.get(request_id)
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

    def _record_prompt_logprobs(self, prompt_rows, logits: torch.Tensor) -> None:
        """Batched: each prompt token's log-probability, rank and the top tokens at its
        position, copied to the host once."""
        if not prompt_rows:
            return
        targets = [request.prompt_token_ids[position + 1] for _, request, position in prompt_rows]
        num_top = max(request.params.prompt_logprobs for _, request, _ in prompt_rows)
        columns = self.sampler.logprob_columns(logits, torch.tensor(targets, device=logits.device), num_top)
        for (_, request, _), token, row in zip(prompt_rows, targets, columns.cpu().tolist()):
            top_ids = [int(top_id) for top_id in row[2 : 2 + num_top]]
            request.prompt_logprobs.append(
                self._logprob_entry(
                    token, row[0], int(row[1]), top_ids, row[2 + num_top :], request.params.prompt_logprobs
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

    def _sampling_rows(
        self, out: SchedulerOutput
    ) -> tuple[list[SamplingRow], list[tuple[int, list[int]]], list[tuple[int, int]]]:
        """Each logits row's `SamplingRow` (the core says whose row it is), the tokens banned
        per row for choices still short of ``min_tokens``, and ``(row, matcher)`` of the
        constrained rows."""
        request_ids = out.request_ids
        rows, banned, constrained = [], [], []
        for row, (seq, index) in enumerate(
            zip(out.logits_request_indices.tolist(), out.logits_choice_indices.tolist())
        ):
            choice = self._requests[request_ids[seq]].choices[index]
            rows.append(choice.sampling)
            if choice.matcher is not None:
                constrained.append((row, choice.matcher))
            if choice.banned_token_ids and len(choice.output.token_ids) < choice.sampling.params.min_tokens:
                # NOTE: a constrained output whose grammar has ended may only stop: its
                # constraint outranks min_tokens (banning EOS would leave it nothing).
                if choice.matcher is None or not self.grammars.is_finished(choice.matcher):
                    banned.append((row, choice.banned_token_ids))
        return rows, banned, constrained

    def _fill_masks(self, matchers: list[int]) -> Future[np.ndarray]:
        """The constrained rows' token bitmasks, computed by the core on the mask thread."""
        return self._mask_thread.submit(self.grammars.fill_bitmask, matchers)

    def _append(
        self,
        request: _Request,
        choice: _Choice,
        token: int,
        sampled: SamplerOutput | None,
        row: int,
        core_finished: bool,
    ) -> None:
        output = choice.output
        if choice.matcher is not None:
            if not self.grammars.advance(choice.matcher, token):
                raise RuntimeError(f"token {token} was sampled against the request's output constraint")
            if token == self.eos_token_id and not core_finished and self.grammars.is_finished(choice.matcher):
                # Its constraint outranked min_tokens (`_sampling_rows`): the core, which still
                # holds EOS back, is told the choice has ended.
                choice.output.finish_reason = "stop"
                self.scheduler.finish_request(request.request_id, "stop", choice.output.index)
        output.token_ids.append(token)
        if output.logprobs is not None and sampled is not None and sampled.logprobs is not None:
            logprobs, ranks, top_ids, top_logprobs = sampled.logprob_lists()
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
