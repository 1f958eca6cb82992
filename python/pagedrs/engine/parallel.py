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
import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pagedrs.config import EngineConfig
from pagedrs.engine.model_runner import StepArrays

logger = logging.getLogger("pagedrs")

BACKENDS = ("gloo", "nccl")

# NOTE: each process sets its own timeout on the step group. Rank 0 uses
# ``distributed_timeout``: gloo delivers a message only once the receiver waits for it, and a
# healthy worker always waits for the next step, so a send that takes longer means a stuck
# worker. Workers wait as long as rank 0 stays idle: they never time out there (a rank 0 that
# dies closes its sockets, which ends the wait at once).
_IDLE_TIMEOUT = timedelta(days=3650)
_LOAD_TIMEOUT = timedelta(hours=1)
"""How long ranks wait for each other to load their shards."""

_STEP, _STOP = 1, 2
_JOINED = "pagedrs/joined/"
# The step's arrays in `StepArrays` order: (dtype, 2-D).
_LAYOUT = tuple(
    (np.dtype(dtype), matrix)
    for dtype, matrix in (
        (np.int64, False),  # input_token_ids
        (np.int64, False),  # positions
        (np.int64, False),  # slot_mapping
        (np.int32, False),  # query_start_loc
        (np.int32, False),  # context_lens
        (np.int32, True),  # block_tables
        (np.int64, False),  # logits_rows
        (np.int64, True),  # block_copies
    )
)
HEADER_LEN = 2 + 2 * len(_LAYOUT)
"""int64s of a step header: command, payload bytes, then two dimensions per array."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (died, raised or timed out): the engine cannot go on."""


# -- the step message ----------------------------------------------------------------------


def _padded(num_bytes: int) -> int:
    return (num_bytes + 7) & ~7


def pack_step(arrays: StepArrays) -> tuple[np.ndarray, np.ndarray]:
    """``(header, payload)``: the header holds each array's shape, the payload their bytes,
    each padded to 8 bytes (so every array unpacks aligned)."""
    header = np.zeros(HEADER_LEN, np.int64)
    parts = []
    for i, (array, (dtype, matrix)) in enumerate(zip(arrays, _LAYOUT)):
        array = np.ascontiguousarray(array, dtype=dtype)
        if array.ndim != (2 if matrix else 1):
            raise ValueError(f"step array {StepArrays._fields[i]} has {array.ndim} dimensions")
        header[2 + 2 * i : 4 + 2 * i] = array.shape if matrix else (array.shape[0], 1)
        parts.append(array.view(np.uint8).reshape(-1))
        pad = _padded(array.nbytes) - array.nbytes
        if pad:
            parts.append(np.zeros(pad, np.uint8))
    payload = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    header[0], header[1] = _STEP, payload.nbytes
    return header, payload


def unpack_step(header: np.ndarray, payload: np.ndarray) -> StepArrays:
    arrays = []
    offset = 0
    for i, (dtype, matrix) in enumerate(_LAYOUT):
        rows, cols = int(header[2 + 2 * i]), int(header[3 + 2 * i])
        count = rows * cols
        array = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
        arrays.append(array.reshape(rows, cols) if matrix else array)
        offset += _padded(count * dtype.itemsize)
    return StepArrays(*arrays)


# -- who is who ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSetup:
    """One rank's place in the group and how it meets the others."""

    rank: int
    world_size: int
    local_rank: int
    """Index among the ranks of this node (its GPU on CUDA)."""
    local_world_size: int
    backend: str
    timeout: float
    """Seconds a forward-pass collective may wait."""
    master_addr: str
    master_port: int
    device_type: str
    launched: bool = False
    """Started by a launcher (torchrun), which also runs the rendezvous store."""


def launched_setup(config: EngineConfig, device: torch.device) -> RankSetup | None:
    """This process's rank when a launcher (``torchrun``, or anything that sets ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK``) started the ranks,
    completed from ``config``; ``None`` otherwise. Every rank runs the same command line.
    With ``tensor_parallel_size == 1`` the variables are not ours (a data-parallel launch of one
    engine per rank, say) and are ignored."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if config.tensor_parallel_size == 1 or not all(name in os.environ for name in names):
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != config.tensor_parallel_size:
        raise ValueError(
            f"the launcher started {world_size} ranks but tensor_parallel_size is {config.tensor_parallel_size}"
        )
    first = _node_setups(config, device)[0]
    return dataclasses.replace(
        first,
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        launched=True,
    )


def check_parallel_config(config: EngineConfig, device: torch.device) -> None:
    """Raises ``ValueError`` for tensor-parallel settings that cannot work."""
    size, nnodes = config.tensor_parallel_size, config.nnodes
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if not isinstance(nnodes, int) or nnodes < 1 or size % nnodes != 0:
        raise ValueError(f"nnodes must be a positive divisor of tensor_parallel_size ({size}), got {nnodes!r}")
    if not isinstance(config.node_rank, int) or not 0 <= config.node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}), got {config.node_rank!r}")
    if nnodes > 1 and config.master_port is None:
        raise ValueError("more than one node needs master_port (--master-port): every node must name the same one")
    if config.distributed_backend not in (None, *BACKENDS):
        choices = ", ".join(BACKENDS)
        raise ValueError(f"distributed_backend must be one of {choices}, got {config.distributed_backend!r}")
    if config.distributed_backend == "nccl" and device.type != "cuda":
        raise ValueError("the nccl backend needs CUDA devices; use gloo on the CPU")
    if not config.distributed_timeout > 0:
        raise ValueError(f"distributed_timeout must be positive, got {config.distributed_timeout!r}")
    if device.type == "cuda" and size > 1:
        if device.index is not None:
            raise ValueError(f"with tensor parallelism rank r of a node uses cuda:r; pass device='cuda', not {device}")
        per_node = size // nnodes
        if per_node > torch.cuda.device_count():
            raise ValueError(f"{per_node} ranks per node need as many GPUs; this node has {torch.cuda.device_count()}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _node_setups(config: EngineConfig, device: torch.device) -> list[RankSetup]:
    """The setups of this node's ranks (from ``config.node_rank``), first rank first."""
    per_node = config.tensor_parallel_size // config.nnodes
    port = config.master_port if config.master_port is not None else _free_port()
    backend = config.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    first = config.node_rank * per_node
    return [
        RankSetup(
            rank=first + local,
            world_size=config.tensor_parallel_size,
            local_rank=local,
            local_world_size=per_node,
            backend=backend,
            timeout=config.distributed_timeout,
            master_addr=config.master_addr,
            master_port=port,
            device_type=device.type,
        )
        for local in range(per_node)
    ]


def _rank_device(setup: RankSetup) -> torch.device:
    return torch.device("cuda", setup.local_rank) if setup.device_type == "cuda" else torch.device("cpu")


def _share_cores(local_world_size: int) -> None:
    """Each rank of a node gets its share of the cores (unless ``OMP_NUM_THREADS`` says): on
    the CPU, ranks with a thread per core each would fight over them."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world_size))


def _connect(setup: RankSetup, workers_alive: Callable[[], bool] | None = None) -> Any:
    """Joins the rendezvous and the process group; returns the gloo group rank 0 sends step
    messages on (its timeouts: see `_IDLE_TIMEOUT`). Every rank calls
    this. Rank 0 passes ``workers_alive`` (its local workers), so a worker that dies before it
    joins fails the start at once instead of after the whole timeout."""
    if setup.device_type == "cuda":
        torch.cuda.set_device(_rank_device(setup))
    timeout = timedelta(seconds=setup.timeout)
    if setup.launched:  # the launcher's store (torchrun's agent store), found through env://
        dist.init_process_group(
            setup.backend, init_method="env://", rank=setup.rank, world_size=setup.world_size, timeout=timeout
        )
    else:
        # torch's TCPStore rendezvous, driven here so rank 0 can watch its workers meanwhile.
        store = dist.TCPStore(
            setup.master_addr,
            setup.master_port,
            setup.world_size,
            is_master=setup.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        store.set(f"{_JOINED}{setup.rank}", "1")
        if workers_alive is not None:
            _wait_for_ranks(store, setup, workers_alive)
        dist.init_process_group(
            setup.backend, store=store, rank=setup.rank, world_size=setup.world_size, timeout=timeout
        )
    step_timeout = timeout if setup.rank == 0 else _IDLE_TIMEOUT
    return dist.new_group(backend="gloo", timeout=step_timeout)


def _wait_for_ranks(store: Any, setup: RankSetup, workers_alive: Callable[[], bool]) -> None:
    keys = [f"{_JOINED}{rank}" for rank in range(setup.world_size)]
    deadline = time.monotonic() + setup.timeout
    while not store.check(keys):
        if not workers_alive():
            raise RuntimeError(
                "a worker exited before it joined the rendezvous (its error is in the log above; a script "
                "that starts a tensor-parallel engine must do so under `if __name__ == '__main__':`)"
            )
        if time.monotonic() > deadline:
            joined = sum(store.check([key]) for key in keys)
            raise TimeoutError(
                f"{joined} of {setup.world_size} ranks joined the rendezvous at "
                f"{setup.master_addr}:{setup.master_port} within {setup.timeout:g} s"
            )
        time.sleep(0.05)


def _disconnect() -> None:
    with contextlib.suppress(Exception):  # a failed group may not tear down cleanly
        if dist.is_initialized():
            dist.destroy_process_group()


# -- rank 0 ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """What rank 0 tells every rank to build, so no rank can disagree with it."""

    config: EngineConfig
    num_blocks: int
    dtype: torch.dtype


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
            setup, *others = _node_setups(config, device)
        self.setup = setup
        self.failure: str | None = None
        """Why a rank failed, once one has (set by the monitor thread or by `guard`)."""
        self._closed = False
        self._errors = _spawn_context().SimpleQueue()
        self._errors_lock = threading.Lock()
        self._error_lines: list[str] = []
        self.workers = [_start_worker(other, self._errors) for other in others]
        if setup.local_world_size > 1:
            _share_cores(setup.local_world_size)
        try:
            self._step_group = _connect(setup, workers_alive=lambda: not self._any_worker_exited())
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
            dist.monitored_barrier(group=self._step_group, timeout=_LOAD_TIMEOUT)

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
                header[0] = _STOP
                dist.broadcast(torch.from_numpy(header), src=0, group=self._step_group)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.is_alive():
                logger.warning("tensor-parallel worker pid %d did not stop; killing it", worker.pid)
                worker.kill()
                worker.join(5)
        _disconnect()

    def _any_worker_exited(self) -> bool:
        return any(worker.exitcode is not None for worker in self.workers)

    def _watch_workers(self) -> None:
        pending = {worker.sentinel: worker for worker in self.workers}
        while pending and not self._closed:
            for sentinel in multiprocessing.connection.wait(list(pending), timeout=1.0):
                worker = pending.pop(sentinel)  # type: ignore[arg-type]
                if self._closed:
                    return
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


# -- the other ranks -------------------------------------------------------------------------


def _spawn_context() -> Any:
    return multiprocessing.get_context("spawn")


def _start_worker(setup: RankSetup, errors: Any) -> multiprocessing.process.BaseProcess:
    process = _spawn_context().Process(
        target=_spawned_worker, args=(setup, errors), name=f"pagedrs-tp-rank{setup.rank}", daemon=True
    )
    process.start()
    return process


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies, however it dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _spawned_worker(setup: RankSetup, errors: Any) -> None:
    _die_with_parent()
    if os.getppid() == 1:  # the parent died before the line above took effect
        sys.exit(1)
    sys.exit(run_worker(setup, errors))


def run_worker(setup: RankSetup, errors: Any = None) -> int:
    """One non-zero rank, until rank 0 says stop (returns 0) or anything fails (returns 1,
    after logging why and telling rank 0 through ``errors`` when it is local)."""
    # Ctrl-C reaches the whole process group: rank 0 handles it and tells the workers to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {setup.rank}: %(message)s")
    try:
        if setup.local_world_size > 1:
            _share_cores(setup.local_world_size)
        step_group = _connect(setup)
        spec: list[Any] = [None]
        dist.broadcast_object_list(spec, src=0, group=step_group)
        runner = _load_shard(spec[0], setup)
        dist.monitored_barrier(group=step_group, timeout=_LOAD_TIMEOUT)
        _serve_steps(runner, step_group)
        return 0
    except Exception as error:  # reported to rank 0 and logged; the process exits
        logger.exception("tensor-parallel rank %d failed", setup.rank)
        if errors is not None:
            with contextlib.suppress(Exception):
                errors.put((setup.rank, f"{type(error).__name__}: {error}"))
        return 1
    finally:
        _disconnect()


def _load_shard(spec: ShardSpec, setup: RankSetup) -> Any:
    from pagedrs.engine.model_runner import load_model_runner

    return load_model_runner(
        spec.config, spec.dtype, _rank_device(setup), spec.num_blocks, rank=setup.rank, size=setup.world_size
    )


def _serve_steps(runner: Any, step_group: Any) -> None:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=step_group)
        command, num_bytes = int(header[0]), int(header[1])
        if command == _STOP:
            return
        if command != _STEP:
            raise RuntimeError(f"unknown step command {command}")
        payload = torch.empty(num_bytes, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=step_group)
        runner.forward(unpack_step(header.numpy(), payload.numpy()))


def run_node(config: EngineConfig, device: torch.device | None = None) -> int:
    """A headless node (``node_rank > 0``): runs this node's ranks until rank 0 stops them.
    Returns 0 when all stopped cleanly, 1 otherwise."""
    device = device or config.torch_device()
    check_parallel_config(config, device)
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine; run_node serves the other nodes")
    first, *others = _node_setups(config, device)
    errors = _spawn_context().SimpleQueue()
    workers = [_start_worker(setup, errors) for setup in others]
    status = run_worker(first, errors)
    for worker in workers:
        worker.join()
        status = status or (1 if worker.exitcode else 0)
    return status
