"""`LLMEngine`: the engine core's step, over three rooms (as vLLM arranges them):

- `pagedrs.engine.builder`: the parts, built from an `EngineConfig` (model, ranks, KV plan);
- `pagedrs.engine.executor`: forward pass and sampler, arrays in, sampled arrays out;
- `pagedrs.engine.output_processor`: request state, detokenizing, stop strings, logprobs.

One step = schedule (Rust) -> execute -> update_from_output (Rust, columns out) -> process.
"""

from __future__ import annotations

from typing import Any

from pagedrs._core import GrammarMatchers, Scheduler, SchedulerOutput
from pagedrs.config import EngineConfig
from pagedrs.engine.builder import EngineInfo, load_engine_parts
from pagedrs.engine.executor import Executor
from pagedrs.engine.host_memory import retain_freed_host_memory
from pagedrs.engine.model_runner import ModelRunner
from pagedrs.engine.output_processor import OutputProcessor, Pooler
from pagedrs.engine.parallel import TensorParallelRunner
from pagedrs.engine.request_state import StructuredOutputStats, _Request
from pagedrs.inference_mode import inference_mode
from pagedrs.lora.adapter import LoRARequest
from pagedrs.lora.manager import LoRAManager
from pagedrs.outputs import RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sample import Sampler
from pagedrs.sampling_params import SamplingParams

__all__ = ["LLMEngine", "StructuredOutputStats"]


class LLMEngine:
    """The offline engine. Not thread-safe: one caller steps it."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any):
        config = config or EngineConfig(**kwargs)
        retain_freed_host_memory()
        parts = load_engine_parts(config)
        self.config = config
        self.info: EngineInfo = parts.info
        """What is served (model, dtype, device, limits), for the server and its metrics."""
        self.hf_config = parts.hf_config
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.model = parts.runner.model
        self.drafter = parts.drafter
        self.parallel = parts.parallel
        """The other tensor-parallel ranks (this engine is rank 0), when there are any."""
        self.eos_token_id = self.tokenizer.eos_token_id
        self.lora: LoRAManager | None = None
        """The adapters (``enable_lora``), else ``None``."""
        if config.enable_lora:
            # (the activations' dtype: a packed model's first parameters are bytes)
            self.lora = LoRAManager.of(self.model, config, self.info.device, self.info.dtype)
            runner = self.runner.runner if isinstance(self.runner, TensorParallelRunner) else self.runner
            assert isinstance(runner, ModelRunner)
            runner.lora = self.lora
            if self.parallel is not None:  # the other ranks load their shards into the same slots
                self.lora.on_slot_load = self.parallel.send_lora
            if runner.cpu_stack is not None:  # adapter steps stay one compiled call
                runner.cpu_stack.attach_lora(self.lora.slots)
        self.processor = OutputProcessor(
            parts.scheduler,
            self.tokenizer,
            parts.sampler,
            self.hf_config.vocab_size,
            self.info.max_model_len,
            config.max_num_seqs,
            self.info.device,
            speculative=self.info.speculative is not None,
            rope_salt=self.runner.model.cache_salt,
            pooler=Pooler(
                self.hf_config.hidden_size,
                self.model.classify if self.model.score is not None else None,
                generates=not self.model.sequence_classifier,
                num_labels=self.model.score.out_features if self.model.score is not None else 0,
            ),
            lora=self.lora,
        )
        self.executor = Executor(
            self.runner,
            parts.sampler,
            self.drafter,
            # NOTE: a bound method of the processor, not a closure over the engine: a reference
            # cycle would keep a dropped engine (and its KV cache) alive until the next GC pass.
            self.processor.fill_bitmask,
            self.hf_config.vocab_size,
        )
        self.last_schedule: SchedulerOutput | None = None
        """The last step's batch (`SchedulerOutput`), for metrics and benchmarks."""

    # What the engine serves, by the names callers have always used.
    model_name = property(lambda self: self.info.model_name)
    architecture = property(lambda self: self.info.architecture)
    dtype = property(lambda self: self.info.dtype)
    device = property(lambda self: self.info.device)
    max_model_len = property(lambda self: self.info.max_model_len)
    speculative = property(lambda self: self.info.speculative)

    @property
    def scheduler(self) -> Scheduler:
        """The Rust core (the output processor's too: setting it sets both)."""
        return self.processor.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self.processor.scheduler = scheduler

    @property
    def sampler(self) -> Sampler:
        """The sampler of the executor and the output processor (setting it sets both)."""
        return self.executor.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.executor.sampler = self.processor.sampler = sampler

    @property
    def _requests(self) -> dict[str, _Request]:
        return self.processor.requests

    @property
    def grammars(self) -> GrammarMatchers:
        return self.processor.grammars

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues a request: one to generate (`SamplingParams`), or one that pools its prompt's
        hidden states into an embedding or scores (`PoolingParams`; its output's ``pooled``).
        ``lora_request``: the adapter it generates with (an engine built with ``enable_lora``;
        while every slot is held by other adapters it waits). Bad input raises ``ValueError``
        and queues nothing.

        Admission is atomic: everything the request needs (token ids, generators, penalty
        slots, detokenizers) is checked and built before the core sees it, and if the core
        refuses it, what was built is released. A refused request leaves no trace.
        """
        self.processor.add(request_id, prompt, params or SamplingParams(), priority, cache_salt, lora_request)

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its blocks; unknown ids are ignored."""
        request = self.processor.requests.get(request_id)
        if request is None:
            return
        waiting = request.waiting_for_slot  # (never reached the scheduler)
        self.processor.forget(request)
        if not waiting:
            self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests)

    def structured_output_stats(self) -> StructuredOutputStats:
        """Call between steps (from the thread that steps the engine)."""
        return self.processor.structured_output_stats()

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
        self.executor.shutdown()

    # -- the step --------------------------------------------------------------------------

    @inference_mode
    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the requests that got a token or finished.

        A failure fails only the requests it touches: an exception while handling one
        request's token ends that request (finish reason ``"error"``); one in the forward
        pass or the sampler ends the requests of that batch. Either way their blocks are
        freed and the engine goes on with the others.
        """
        self.check_health()
        if self.lora is not None:
            self.processor.admit_waiting()
        out = self.scheduler.schedule()
        self.last_schedule = out
        result = self.executor.execute(out, self.processor.sampling_inputs)
        self.processor.fail_requests(result.failed)
        updates = self.scheduler.update_from_output(result.token_ids, result.draft_token_ids)
        return self.processor.process(updates, result)
