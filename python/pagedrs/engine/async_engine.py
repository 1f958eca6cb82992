"""`AsyncLLMEngine`: the engine loop on a thread of its own, requests as async streams.

The `LLMEngine` is not thread-safe, so one thread owns it: it takes commands (add, abort)
between steps, steps while there is work, and hands each request's outputs to the asyncio
loop that asked for them. The event loop never waits for a step; an add or abort waits at
most for the step in progress to end. While the stream's consumer reads, the engine goes on.

Which thread: by default a background one. `pagedrs serve` instead runs the loop on the
process's main thread (`run`) and the HTTP server on a background one, because on the CPU
torch's small matrix products run ~30% slower from a non-main thread (measured in
docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pagedrs.engine.builder import EngineInfo
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.engine.output_processor import Pooler
from pagedrs.outputs import RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedrs.lora.adapter import LoRARequest

logger = logging.getLogger("pagedrs")


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit: try again later (HTTP 503)."""


class DrainingError(QueueFullError):
    """The server is shutting down (`AsyncLLMEngine.drain`): it finishes the requests it has
    and takes no new ones (HTTP 503; another replica should take it)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass(frozen=True)
class LoRAAdapters:
    """What ``pagedrs:lora_requests_info`` reports: ``(max_loras, running names, waiting
    names)`` (comma-separated), and when that last changed (Unix time)."""

    labels: tuple[str, str, str]
    since: float


class StatLogger(Protocol):
    """What the engine thread reports, for metrics. Called on the engine thread."""

    def record_step(self, engine: LLMEngine) -> None: ...
    def record_request_tokens(
        self, output: RequestOutput, num_new_tokens: int, first: bool, since_last: float
    ) -> None: ...
    def record_finished(self, output: RequestOutput, e2e_seconds: float) -> None: ...


@dataclass
class _Stream:
    """One request's side of the hand-over: outputs go into an asyncio queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    hold_back: int = 0
    """Characters of unfinished text not yet shown (the longest stop string, less one)."""
    last_token_time: float | None = None
    num_tokens: int = 0
    sent: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """Per choice: tokens, characters and logprob entries handed over so far (engine thread)."""
    num_sent_prompt_logprobs: int = 0

    def delta(self, output: RequestOutput) -> RequestOutput:
        """What ``output`` holds beyond what was handed over (engine thread): only the new
        tokens, text and logprobs are copied, so a step costs what it added, not the length
        of the stream. Unfinished text stops ``hold_back`` characters short, so text that may
        turn out to start a stop string is never sent (it could be taken back when the stop
        string completes)."""
        choices = []
        for choice in output.outputs:
            num_tokens, num_chars, num_logprobs = self.sent.get(choice.index, (0, 0, 0))
            visible = len(choice.text)
            if self.hold_back and not choice.finished():
                visible = max(visible - self.hold_back, num_chars)
            logprobs = None if choice.logprobs is None else choice.logprobs[num_logprobs:]
            choices.append(
                dataclasses.replace(
                    choice,
                    text=choice.text[num_chars:visible],
                    token_ids=choice.token_ids[num_tokens:],
                    logprobs=logprobs,
                )
            )
            self.sent[choice.index] = (
                len(choice.token_ids),
                visible,
                num_logprobs if choice.logprobs is None else len(choice.logprobs),
            )
        prompt_logprobs = output.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs, self.num_sent_prompt_logprobs = (
                prompt_logprobs[self.num_sent_prompt_logprobs :],
                len(prompt_logprobs),
            )
        return dataclasses.replace(output, outputs=choices, prompt_logprobs=prompt_logprobs)

    def put(self, item: RequestOutput | BaseException | None) -> bool:
        """Hands `item` to the reader's loop; False if that loop has closed (nobody reads)."""
        return _call_soon(self.loop, self.queue.put_nowait, item)


class RequestStream:
    """A queued request's outputs, as an async iterator; the last one has ``finished`` set.

    - By default each output is a cumulative snapshot: everything so far, in objects the
      engine never touches again.
    - With ``delta=True`` (vLLM's ``RequestOutputKind.DELTA``) each output holds only what is
      new since the one before: text, token ids and logprobs; the rest (finish reason, counts)
      as of now.

    The engine thread hands over deltas either way; snapshots are built here, on the reader's
    loop.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, stream: _Stream, delta: bool = False):
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self.delta = delta
        self.finished = False
        self._so_far: RequestOutput | None = None
        """Cumulative mode: the deltas so far, added up."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._stream.queue.get()
            if item is None:  # aborted
                self.finished = True
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            if self.delta:
                yield item
            else:
                self._so_far = add_delta(self._so_far, item)
                yield _copy(self._so_far)

    def abort(self) -> None:
        """Ends the request unless it has finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def add_delta(so_far: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """``delta`` (a `RequestStream` delta) added to ``so_far`` in place (a new cumulative
    output when ``so_far`` is None); returns the cumulative output."""
    if so_far is None:
        so_far = dataclasses.replace(delta, outputs=[], prompt_logprobs=None)
    so_far.finished, so_far.num_cached_tokens, so_far.error = delta.finished, delta.num_cached_tokens, delta.error
    so_far.pooled = delta.pooled
    if delta.prompt_logprobs is not None:
        so_far.prompt_logprobs = (so_far.prompt_logprobs or []) + delta.prompt_logprobs
    by_index = {choice.index: choice for choice in so_far.outputs}
    for new in delta.outputs:
        old = by_index.get(new.index)
        if old is None:
            old = dataclasses.replace(new, text="", token_ids=[], logprobs=None if new.logprobs is None else [])
            so_far.outputs.append(old)
            by_index[new.index] = old
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if new.logprobs is not None and old.logprobs is not None:
            old.logprobs.extend(new.logprobs)
        old.cumulative_logprob, old.finish_reason, old.stop_reason = (
            new.cumulative_logprob,
            new.finish_reason,
            new.stop_reason,
        )
    return so_far


def _copy(output: RequestOutput) -> RequestOutput:
    """A copy whose lists are its own (the stream goes on adding to the original)."""
    outputs = [
        dataclasses.replace(
            choice,
            token_ids=list(choice.token_ids),
            logprobs=None if choice.logprobs is None else list(choice.logprobs),
        )
        for choice in output.outputs
    ]
    prompt_logprobs = None if output.prompt_logprobs is None else list(output.prompt_logprobs)
    return dataclasses.replace(output, outputs=outputs, prompt_logprobs=prompt_logprobs)


class AsyncLLMEngine:
    """Serves an `LLMEngine` to asyncio code.

    ``max_waiting_requests``: when this many requests are queued and not yet running, new
    ones fail at once with `QueueFullError` instead of piling up (``None``: no limit).
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        stat_logger: StatLogger | None = None,
        start_thread: bool = True,
    ):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stat_logger = stat_logger
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self._stopping = False
        self._stopped = False
        self._drain_deadline: float | None = None
        """Set by `drain`: when the requests still in flight are aborted."""
        self._stop_reason: str | None = None
        self._dead: BaseException | None = None
        self.stats = engine.scheduler.stats()
        """The scheduler's counters after the last step (published by the engine thread)."""
        self.lora_adapters: LoRAAdapters | None = None
        """With ``enable_lora``: the adapters running and waiting, as last published (engine thread)."""
        self._publish_lora()
        self._core_waiting = self.stats.num_waiting
        """The core's waiting count as last published (after a step, an add or an abort)."""
        self.structured_output_stats = engine.structured_output_stats()
        """Likewise, the structured-output counters."""
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self.run, name="pagedrs-engine", daemon=True)
            self._thread.start()

    # -- called from the event loop ------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def info(self) -> EngineInfo:
        """What the engine serves (fixed at start-up: safe to read from any thread)."""
        return self.engine.info

    @property
    def pooler(self) -> Pooler:
        """What pooling requests may ask of the model (fixed at start-up)."""
        return self.engine.processor.pooler

    def broadcast_stats(self) -> dict[str, float] | None:
        """With tensor parallelism: steps sent to the other ranks, their bytes and seconds."""
        parallel = self.engine.parallel
        return parallel.broadcast_stats() if parallel is not None else None

    def expert_tokens(self) -> dict[int, torch.Tensor]:
        """Each mixture-of-experts layer's routed (token, slot) pairs per expert
        (`ModelRunner.expert_tokens`; read while the engine runs: a scrape's snapshot)."""
        return self.engine.runner.expert_tokens()

    def is_alive(self) -> bool:
        return not self._stopped and self._dead is None

    @property
    def draining(self) -> bool:
        """`drain` was called: requests in flight finish, new ones are refused."""
        return self._drain_deadline is not None

    @property
    def dead_reason(self) -> BaseException | None:
        """What killed the engine loop, if anything did."""
        return self._dead

    def num_waiting(self) -> int:
        """Requests queued but not running: the engine's waiting queue and adds in flight."""
        with self._pending_lock:
            return self._num_waiting_locked()

    def _num_waiting_locked(self) -> int:
        return self._core_waiting + self._pending_adds

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queues a request; returns once the engine has taken it. Bad input raises
        ``ValueError`` (nothing is queued), a full waiting queue `QueueFullError`. The caller
        reads the returned stream (cumulative outputs, or deltas with ``delta``: see
        `RequestStream`) and must `RequestStream.abort` it if it stops early."""
        if not self.is_alive():
            raise EngineDeadError("the engine has stopped") from self._dead
        if self.draining:
            raise DrainingError("the server is shutting down and takes no new requests")
        loop = asyncio.get_running_loop()
        stop_strings = params.stop_strings if isinstance(params, SamplingParams) else []
        stream = _Stream(loop, hold_back=max(map(len, stop_strings), default=1) - 1)
        added = loop.create_future()
        # NOTE: checked and counted under one lock, and the engine thread publishes the core's
        # waiting count before it stops counting an add as pending (`_add`), so a request is
        # always counted once: the queue never exceeds the limit, however many arrive at once.
        with self._pending_lock:
            waiting = self._num_waiting_locked()
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{waiting} requests are waiting (limit {self.max_waiting_requests})")
            self._pending_adds += 1
        self._commands.put(("add", request_id, prompt, params, priority, cache_salt, lora_request, stream, added))
        if not self.is_alive():  # stopped after the check above: nobody will read the command
            self._fail_pending_commands(EngineDeadError("the engine has stopped"))
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still go through: take it back
            raise
        return RequestStream(self, request_id, stream, delta)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`add_request`, then the request's outputs until it finishes; leaving the
        iteration early aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Ends a request at the next step boundary and frees its blocks."""
        self._commands.put(("abort", request_id))

    def stop(self) -> None:
        """Makes `run` return after the step in progress (safe from any thread or a signal
        handler)."""
        self._stopping = True
        self._commands.put(("wake",))

    def drain(self, timeout: float) -> None:
        """Stops taking requests (`add_request` raises `DrainingError`) and lets those in flight
        finish; `run` returns once none is left. Those still running ``timeout`` seconds later
        are aborted: their streams end with an `EngineDeadError` saying so. Safe from any thread
        or a signal handler; a second call changes nothing."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + max(0.0, timeout)
            self._commands.put(("wake",))

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """The engine loop, on the calling thread, until `stop` (or until ``until()`` is
        true: checked at least once a second)."""
        try:
            # In inference mode once for every step (see pagedrs.inference_mode).
            with torch.inference_mode():
                while not self._stopping:
                    if until is not None and until():
                        break
                    if self._drain_deadline is not None and self._drained():
                        break
                    self.engine.check_health()  # a tensor-parallel rank that failed while idle
                    # NOTE: while draining, an idle loop waits briefly, so that it ends (and the
                    # process exits) right after the last request in flight.
                    idle = not self.engine.has_unfinished_requests()
                    self._drain_commands(block=idle, timeout=1.0 if self._drain_deadline is None else 0.02)
                    if self._stopping or not self.engine.has_unfinished_requests():
                        continue
                    outputs = self.engine.step()
                    self._publish_stats()
                    self.structured_output_stats = self.engine.structured_output_stats()
                    if self.stat_logger is not None:
                        self.stat_logger.record_step(self.engine)
                    self._deliver(outputs)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # every waiting stream must hear of it
            logger.exception("the engine loop died")
            self._dead = error
        finally:
            self._stopped = True
            # Whoever still waits hears why: a dead engine, or a server shutting down.
            reason = EngineDeadError(
                f"the engine stopped: {self._dead}" if self._dead else self._stop_reason or "the engine was stopped"
            )
            for request_id in list(self._streams):
                with contextlib.suppress(Exception):  # (a dead engine may refuse)
                    self.engine.abort_request(request_id)
            for stream in self._streams.values():
                stream.put(reason)
            self._streams.clear()
            self._fail_pending_commands(reason)

    def _drained(self) -> bool:
        """While draining: whether the loop may end (nothing left, or the time is up)."""
        assert self._drain_deadline is not None
        with self._pending_lock:
            pending = self._pending_adds
        if not pending and self._commands.empty() and not self.engine.has_unfinished_requests():
            return True
        if time.monotonic() < self._drain_deadline:
            return False
        self._stop_reason = (
            f"the server shut down before this request finished (--shutdown-timeout); {len(self._streams)} "
            "requests were aborted"
        )
        logger.warning("%s", self._stop_reason)
        return True

    def _drain_commands(self, block: bool, timeout: float = 1.0) -> None:
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])

    def _add(self, request_id, prompt, params, priority, cache_salt, lora_request, stream: _Stream, added) -> None:
        try:
            self.engine.add_request(
                request_id, prompt, params, priority=priority, cache_salt=cache_salt, lora_request=lora_request
            )
        except Exception as error:  # noqa: BLE001 - handed to the caller
            _call_soon(stream.loop, _set_exception, added, error)
        else:
            self._streams[request_id] = stream
            if not _call_soon(stream.loop, _set_result, added, None):
                self._abort(request_id)  # the caller's loop has closed
        finally:
            # Only the waiting count (an O(1) read; the full stats walk the queue, and a burst
            # of adds must not cost O(n^2)).
            # (requests waiting for a LoRA slot wait outside the core: they count too)
            waiting = self.engine.scheduler.num_waiting + self.engine.processor.num_waiting_for_slots
            with self._pending_lock:
                self._core_waiting = waiting
                self._pending_adds -= 1

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.engine.abort_request(request_id)
            stream.put(None)  # a reader still waiting learns that the stream has ended
            self._publish_stats()

    def _publish_stats(self) -> None:
        stats = self.engine.scheduler.stats()
        with self._pending_lock:
            self.stats = stats
            self._core_waiting = stats.num_waiting + self.engine.processor.num_waiting_for_slots
        self._publish_lora()

    def _publish_lora(self) -> None:
        lora = self.engine.lora
        if lora is not None:
            processor = self.engine.processor
            labels = (
                str(lora.slots.max_loras),
                ",".join(lora.names(lora.running_ids())),
                ",".join(lora.names(processor.waiting_adapter_ids())),
            )
            if self.lora_adapters is None or labels != self.lora_adapters.labels:
                self.lora_adapters = LoRAAdapters(labels, time.time())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            num_tokens = sum(len(choice.token_ids) for choice in output.outputs)
            if num_tokens > stream.num_tokens and self.stat_logger is not None:
                last = stream.last_token_time
                first = last is None
                since = now - (stream.arrival if last is None else last)
                self.stat_logger.record_request_tokens(output, num_tokens - stream.num_tokens, first, since)
            if num_tokens > stream.num_tokens:
                stream.num_tokens, stream.last_token_time = num_tokens, now
            if not stream.put(stream.delta(output)):
                self._abort(output.request_id)  # its reader is gone for good
                continue
            if output.finished:
                del self._streams[output.request_id]
                if self.stat_logger is not None:
                    self.stat_logger.record_finished(output, now - stream.arrival)

    def _fail_pending_commands(self, reason: EngineDeadError) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                stream, added = command[7], command[8]
                _call_soon(stream.loop, _set_exception, added, reason)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
    """Runs `callback` on `loop`'s thread; False if the loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
