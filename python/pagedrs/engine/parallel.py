"""Tensor parallelism: one process per rank, the scheduler once, in rank 0.

::

    node 0                                          node 1 (--node-rank 1: headless)
    +-------------------------------------------+   +------------------------------+
    | rank 0: the engine (Rust scheduler),       |   | ranks k..2k-1: workers       |
    |   its shard, the sampler, the HTTP server  |   |   (their shards, KV shards)  |
    | ranks 1..k-1: workers, spawned             |   +------------------------------+
    +-------------------------------------------+

Each step rank 0 broadcasts the step's arrays (a fixed-size header, then one packed buffer; see
`pack_step`) on a group of their own; every rank then runs the forward pass on its shard
(all-reduce after row-parallel linears, logits gathered to rank 0) and rank 0 samples. Ranks
meet through torch.distributed's ``env://`` rendezvous (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``), so going multi-node is configuration, and ``torchrun`` may start the
ranks instead (`launched_setup`).

Faults end the engine, never hang it: a local worker that exits is seen at once by a monitor
thread (`TensorParallelGroup.failure`); a rank that dies makes rank 0's next collective fail as
its socket closes, and one that hangs makes it time out (``distributed_timeout``). Either way
the engine raises `TensorParallelError` and stops for good. Workers die with their parent
(``PR_SET_PDEATHSIG``) and leave on rank 0's stop message or a closed connection.

NOTE: on NCCL the forward pass's collectives are asynchronous, so a dead rank may surface at
the next synchronization (in the sampler, outside `guard`) or as NCCL's watchdog aborting the
process after ``distributed_timeout``: the server still ends, possibly by that abort rather
than exit status 1. Only the gloo (CPU) behaviour is tested; see docs/gpu.md. A worker on
another node whose rank 0 vanishes without closing its sockets (power loss, a partition)
waits until killed: idle workers have no timeout, and rank 0 sends no heartbeat.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from pagedrs._core import SchedulerOutput
from pagedrs.config import EngineConfig
from pagedrs.engine.step_arrays import StepArrays, StepLogits
from pagedrs.engine.tp_common import (
    HEADER_LEN,
    LOAD_TIMEOUT,
    LORA,
    STOP,
    ShardSpec,
    TensorParallelError,
    check_parallel_config,
    connect,
    disconnect,
    launched_setup,
    node_setups,
    pack_step,
    share_cores,
)
from pagedrs.engine.tp_worker import spawn_context, start_worker
from pagedrs.lora.adapter import LoRARequest

if TYPE_CHECKING:
    from pagedrs.engine.model_runner import ModelRunner

logger = logging.getLogger("pagedrs")


# -- rank 0 ----------------------------------------------------------------------------------


class TensorParallelGroup:
    """Rank 0's side: starts this node's other ranks, meets the rest, sends each step.

    Each step is `send_step`, then the caller's own forward pass, both inside `guard`, which
    turns any failure into `TensorParallelError`.
    """

    def __init__(self, config: EngineConfig, device: torch.device, num_blocks: int, dtype: torch.dtype):
        check_parallel_config(config, device)
        if config.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes serve their ranks with run_node")
        if dist.is_initialized():
            raise ValueError(
                "torch.distributed is already initialized in this process (another tensor-parallel engine "
                "still running?): shut it down first (LLM.shutdown())"
            )
        launched = launched_setup(config, device)
        if launched is not None:
            if launched.rank != 0:
                raise ValueError(f"the engine is rank 0; this process was launched as rank {launched.rank}")
            setup, others = launched, []  # the launcher started the others
        else:
            setup, *others = node_setups(config, device)
        self.setup = setup
        self.failure: str | None = None
        """Why a rank failed, once one has (set by the monitor thread or by `guard`)."""
        self._closed = False
        self._errors = spawn_context().SimpleQueue()
        self._errors_lock = threading.Lock()
        self._error_lines: list[str] = []
        self.workers = [start_worker(other, self._errors) for other in others]
        if setup.local_world_size > 1:
            share_cores(setup.local_world_size)
        try:
            self._step_group = connect(setup, workers_alive=lambda: not self._any_worker_exited())
            spec = [ShardSpec(config, num_blocks, dtype)]
            dist.broadcast_object_list(spec, src=0, group=self._step_group)
        except BaseException as error:  # Ctrl-C too: no worker may outlive a failed start
            self.shutdown(graceful=False)
            if isinstance(error, Exception):
                raise TensorParallelError(self._describe(error)) from error
            raise
        self._step_seconds = 0.0
        self._step_bytes = 0
        self._num_steps = 0
        self._monitor = threading.Thread(target=self._watch_workers, name="pagedrs-tp-monitor", daemon=True)
        self._monitor.start()
        atexit.register(self.shutdown)

    @property
    def rank(self) -> int:
        return self.setup.rank

    @property
    def size(self) -> int:
        return self.setup.world_size

    @property
    def backend(self) -> str:
        return self.setup.backend

    def wait_until_loaded(self) -> None:
        """Returns once every rank has loaded its shard (rank 0 has, when it calls this)."""
        with self.guard():
            dist.monitored_barrier(group=self._step_group, timeout=LOAD_TIMEOUT)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Any failure inside (a collective, the forward pass) is fatal: the ranks are out of
        step. Raises `TensorParallelError` naming the first cause known. (The engine calls
        `check` before each step.)"""
        try:
            yield
        except KeyboardInterrupt:
            # Ctrl-C mid-step: the workers may sit in a collective, so no goodbye at shutdown.
            self.failure = self.failure or "interrupted during a step"
            raise
        except Exception as error:
            # A dead worker's exit is often seen by the collective first: give its monitor a
            # moment to say which rank it was.
            deadline = time.monotonic() + 1.0
            while self.failure is None and time.monotonic() < deadline and self._any_worker_exited():
                time.sleep(0.01)
            self.failure = self.failure or self._describe(error)
            raise TensorParallelError(self.failure) from error

    def check(self) -> None:
        """Raises `TensorParallelError` if a rank has failed."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def send_step(self, arrays: StepArrays) -> None:
        """Broadcasts one step's arrays to every rank (call inside `guard`)."""
        start = time.perf_counter()
        header, payload = pack_step(arrays)
        dist.broadcast(torch.from_numpy(header), src=0, group=self._step_group)
        dist.broadcast(torch.from_numpy(payload), src=0, group=self._step_group)
        self._step_seconds += time.perf_counter() - start
        self._step_bytes += header.nbytes + payload.nbytes
        self._num_steps += 1

    def send_lora(self, slot: int, request: LoRARequest) -> None:
        """Tells every rank to read ``request``'s adapter (its own shard of it) into ``slot``
        before the next step (the path must be readable on every node)."""
        message = json.dumps(
            {"slot": slot, "name": request.lora_name, "id": request.lora_int_id, "path": os.fspath(request.lora_path)}
        ).encode()
        header = np.zeros(HEADER_LEN, np.int64)
        header[0], header[1] = LORA, len(message)
        with self.guard():
            dist.broadcast(torch.from_numpy(header), src=0, group=self._step_group)
            dist.broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), src=0, group=self._step_group)

    def broadcast_stats(self) -> dict[str, float]:
        """Steps sent, bytes and seconds spent broadcasting them (rank 0's side)."""
        return {"steps": self._num_steps, "bytes": self._step_bytes, "seconds": self._step_seconds}

    def shutdown(self, timeout: float = 10.0, graceful: bool = True) -> None:
        """Tells the workers to leave, waits ``timeout`` for them, kills any that stay.
        Idempotent. (Sending the stop message can itself take up to ``distributed_timeout``
        if a worker is stuck.) ``graceful=False``, or after a failure (the ranks may be out of
        step): kills this node's workers at once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if not graceful or self.failure is not None:  # the ranks are out of step: no goodbyes
            timeout = 0.0
        elif self.failure is None and dist.is_initialized():
            with contextlib.suppress(Exception):
                header = np.zeros(HEADER_LEN, np.int64)
                header[0] = STOP
                dist.broadcast(torch.from_numpy(header), src=0, group=self._step_group)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.is_alive():
                logger.warning("tensor-parallel worker pid %d did not stop; killing it", worker.pid)
                worker.kill()
                worker.join(5)
        disconnect()

    def _any_worker_exited(self) -> bool:
        return any(worker.exitcode is not None for worker in self.workers)

    def _watch_workers(self) -> None:
        pending = {worker.sentinel: worker for worker in self.workers}
        while pending and not self._closed:
            for sentinel in multiprocessing.connection.wait(list(pending), timeout=1.0):
                worker = pending.pop(sentinel)  # type: ignore[arg-type]
                if self._closed:
                    return
                worker.join(1.0)  # reaped: its exit code is known (the sentinel fires first)
                reason = f"tensor-parallel worker (pid {worker.pid}) exited with code {worker.exitcode}"
                reported = self._reported_errors()
                self.failure = self.failure or (f"{reason}: {reported}" if reported else reason)
                logger.error("%s; the engine stops", self.failure)

    def _reported_errors(self) -> str:
        """What workers reported before exiting (kept: the monitor and the engine thread both
        ask, and each must see them all)."""
        with self._errors_lock:  # `empty` then `get` must not interleave with another reader
            while not self._errors.empty():
                rank, text = self._errors.get()
                self._error_lines.append(f"rank {rank} raised {text.strip().splitlines()[-1]}")
            return "; ".join(self._error_lines)

    def _describe(self, error: BaseException) -> str:
        reported = self._reported_errors()
        cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        return f"a tensor-parallel rank failed ({reported or cause})"


class TensorParallelRunner:
    """Rank 0's runner with tensor parallelism: each step goes to the other ranks first, then
    through rank 0's own single-rank `ModelRunner`, both inside the group's `guard`."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup):
        self.runner = runner
        self.group = group
        self.model = runner.model

    def execute(
        self,
        out: SchedulerOutput,
        extra_rows: np.ndarray | None = None,
        pool_rows: np.ndarray | None = None,
        sampled_rows: np.ndarray | None = None,
        lora_rows: np.ndarray | None = None,
    ) -> StepLogits:
        """As `ModelRunner.execute`, on every rank (the pooled rows' hidden states are rank
        0's: every rank ends the layers with the same hidden states)."""
        arrays = StepArrays.of(out, extra_rows, sampled_rows, lora_rows)
        with self.group.guard():
            self.group.send_step(arrays)
            logits, pooled = self.runner.forward_pooled(arrays, pool_rows)
        return StepLogits.split(logits, out, sampled_rows, pooled)

    def expert_tokens(self) -> dict[int, torch.Tensor]:
        """Rank 0's counts (`ModelRunner.expert_tokens`): the router is replicated, every rank
        routes the same tokens to the same experts."""
        return self.runner.expert_tokens()
