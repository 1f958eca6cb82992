"""The non-zero tensor-parallel ranks: spawned by rank 0 (or a headless node, or torchrun), each
loads its shard and runs every step rank 0 broadcasts, until told to stop."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from pagedrs.config import EngineConfig
from pagedrs.engine.tp_common import (
    HEADER_LEN,
    LOAD_TIMEOUT,
    LORA,
    STEP,
    STOP,
    RankSetup,
    ShardSpec,
    check_parallel_config,
    connect,
    disconnect,
    node_setups,
    rank_device,
    share_cores,
    unpack_step,
)

logger = logging.getLogger("pagedrs")


# -- the other ranks -------------------------------------------------------------------------


def spawn_context() -> Any:
    return multiprocessing.get_context("spawn")


def start_worker(setup: RankSetup, errors: Any) -> multiprocessing.process.BaseProcess:
    process = spawn_context().Process(
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
            share_cores(setup.local_world_size)
        step_group = connect(setup)
        spec: list[Any] = [None]
        dist.broadcast_object_list(spec, src=0, group=step_group)
        runner = _load_shard(spec[0], setup)
        dist.monitored_barrier(group=step_group, timeout=LOAD_TIMEOUT)
        _serve_steps(runner, step_group)
        return 0
    except Exception as error:  # reported to rank 0 and logged; the process exits
        logger.exception("tensor-parallel rank %d failed", setup.rank)
        if errors is not None:
            with contextlib.suppress(Exception):
                errors.put((setup.rank, f"{type(error).__name__}: {error}"))
        return 1
    finally:
        disconnect()


def _load_shard(spec: ShardSpec, setup: RankSetup) -> Any:
    from pagedrs.engine.model_runner import load_model_runner

    device = rank_device(setup)
    runner = load_model_runner(spec.config, spec.dtype, device, spec.num_blocks, rank=setup.rank, size=setup.world_size)
    if spec.config.enable_lora:
        from pagedrs.lora.manager import LoRAManager

        runner.lora = LoRAManager.of(runner.model, spec.config, device, spec.dtype)
    return runner


def _serve_steps(runner: Any, step_group: Any) -> None:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=step_group)
        command, num_bytes = int(header[0]), int(header[1])
        if command == STOP:
            return
        if command not in (STEP, LORA):
            raise RuntimeError(f"unknown step command {command}")
        payload = torch.empty(num_bytes, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=step_group)
        if command == LORA:
            _place_adapter(runner, json.loads(payload.numpy().tobytes()))
        else:
            runner.forward(unpack_step(header.numpy(), payload.numpy()))


def _place_adapter(runner: Any, message: dict[str, Any]) -> None:
    """Rank 0 put an adapter in a slot: this rank reads its shard of it into the same slot."""
    from pagedrs.lora.adapter import LoRARequest

    if runner.lora is None:
        raise RuntimeError("rank 0 sent a LoRA adapter to a rank built without enable_lora")
    runner.lora.place(message["slot"], LoRARequest(message["name"], message["id"], message["path"]))


def run_node(config: EngineConfig, device: torch.device | None = None) -> int:
    """A headless node (``node_rank > 0``): runs this node's ranks until rank 0 stops them.
    Returns 0 when all stopped cleanly, 1 otherwise."""
    device = device or config.torch_device()
    check_parallel_config(config, device)
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine; run_node serves the other nodes")
    first, *others = node_setups(config, device)
    errors = spawn_context().SimpleQueue()
    workers = [start_worker(setup, errors) for setup in others]
    status = run_worker(first, errors)
    for worker in workers:
        worker.join()
        status = status or (1 if worker.exitcode else 0)
    return status
