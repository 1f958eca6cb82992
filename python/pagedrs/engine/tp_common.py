"""What every tensor-parallel rank shares (see `pagedrs.engine.parallel` for the picture): the
step message's wire format, each rank's `RankSetup`, the rendezvous and its timeouts, and the
error that ends the engine."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pagedrs.config import EngineConfig
from pagedrs.engine.step_arrays import StepArrays

logger = logging.getLogger("pagedrs")

# NOTE: each process sets its own timeout on the step group. Rank 0 uses
# ``distributed_timeout``: gloo delivers a message only once the receiver waits for it, and a
# healthy worker always waits for the next step, so a send that takes longer means a stuck
# worker. Workers wait as long as rank 0 stays idle: they never time out there (a rank 0 that
# dies closes its sockets, which ends the wait at once).
IDLE_TIMEOUT = timedelta(days=3650)
LOAD_TIMEOUT = timedelta(hours=1)
"""How long ranks wait for each other to load their shards."""

STEP, STOP, LORA = 1, 2, 3
_JOINED = "pagedrs/joined/"
# The step's arrays in `StepArrays` order: (dtype, dimensions).
_LAYOUT = tuple(
    (np.dtype(dtype), ndim)
    for dtype, ndim in (
        (np.int64, 1),  # input_token_ids
        (np.int64, 1),  # positions
        (np.int64, 2),  # slot_mapping: [kv groups, tokens]
        (np.int32, 1),  # query_start_loc
        (np.int32, 1),  # context_lens
        (np.int32, 1),  # prompt_lens
        (np.int32, 3),  # block_tables: [kv groups, sequences, blocks]
        (np.int64, 1),  # logits_rows
        (np.int64, 2),  # block_copies
        (np.int64, 1),  # lora_rows
    )
)
_DIMS = 3
"""Header slots per array (its shape, padded with 1s)."""
HEADER_LEN = 2 + _DIMS * len(_LAYOUT)
"""int64s of a step header: command, payload bytes, then three dimensions per array."""


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
    for i, (array, (dtype, ndim)) in enumerate(zip(arrays, _LAYOUT)):
        array = np.ascontiguousarray(array, dtype=dtype)
        if array.ndim != ndim:
            raise ValueError(f"step array {StepArrays._fields[i]} has {array.ndim} dimensions, not {ndim}")
        start = 2 + _DIMS * i
        header[start : start + _DIMS] = array.shape + (1,) * (_DIMS - ndim)
        parts.append(array.view(np.uint8).reshape(-1))
        pad = _padded(array.nbytes) - array.nbytes
        if pad:
            parts.append(np.zeros(pad, np.uint8))
    payload = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    header[0], header[1] = STEP, payload.nbytes
    return header, payload


def unpack_step(header: np.ndarray, payload: np.ndarray) -> StepArrays:
    arrays = []
    offset = 0
    for i, (dtype, ndim) in enumerate(_LAYOUT):
        start = 2 + _DIMS * i
        shape = tuple(int(n) for n in header[start : start + ndim])
        count = int(np.prod(shape))
        array = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
        arrays.append(array.reshape(shape))
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
    first = node_setups(config, device)[0]
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
    """Raises ``ValueError`` for tensor-parallel settings that cannot work on ``device``
    (each field on its own is checked by `EngineConfig.validate`)."""
    size, nnodes = config.tensor_parallel_size, config.nnodes
    if config.distributed_backend == "nccl" and device.type != "cuda":
        raise ValueError("the nccl backend needs CUDA devices; use gloo on the CPU")
    if device.type == "cuda" and size > 1:
        if device.index is not None:
            raise ValueError(f"with tensor parallelism rank r of a node uses cuda:r; pass device='cuda', not {device}")
        per_node = size // nnodes
        if per_node > torch.cuda.device_count():
            raise ValueError(f"{per_node} ranks per node need as many GPUs; this node has {torch.cuda.device_count()}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def node_setups(config: EngineConfig, device: torch.device) -> list[RankSetup]:
    """The setups of this node's ranks (from ``config.node_rank``), first rank first."""
    per_node = config.tensor_parallel_size // config.nnodes
    port = config.master_port if config.master_port is not None else free_port()
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


def rank_device(setup: RankSetup) -> torch.device:
    return torch.device("cuda", setup.local_rank) if setup.device_type == "cuda" else torch.device("cpu")


def share_cores(local_world_size: int) -> None:
    """Each rank of a node gets its share of the cores (unless ``OMP_NUM_THREADS`` says): on
    the CPU, ranks with a thread per core each would fight over them."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world_size))


def connect(setup: RankSetup, workers_alive: Callable[[], bool] | None = None) -> Any:
    """Joins the rendezvous and the process group; returns the gloo group rank 0 sends step
    messages on (its timeouts: see `IDLE_TIMEOUT`). Every rank calls
    this. Rank 0 passes ``workers_alive`` (its local workers), so a worker that dies before it
    joins fails the start at once instead of after the whole timeout."""
    if setup.device_type == "cuda":
        torch.cuda.set_device(rank_device(setup))
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
    step_timeout = timeout if setup.rank == 0 else IDLE_TIMEOUT
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


def disconnect() -> None:
    with contextlib.suppress(Exception):  # a failed group may not tear down cleanly
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class ShardSpec:
    """What rank 0 tells every rank to build, so no rank can disagree with it."""

    config: EngineConfig
    num_blocks: int
    dtype: torch.dtype
