"""``pagedrs serve --data-parallel-size N``: N engine replicas behind one HTTP front.

Each replica is a ``pagedrs serve`` process of its own (its own Rust core, KV budget and
engine loop) on a loopback port, pinned to its share of the CPU cores (or given its own GPUs).
The front is the Rust router (``pagedrs-router``, docs/router.md), which routes each request
by prefix affinity so that a conversation's next turn finds its KV cached.

This process supervises them:
- a replica that exits is reported and restarted on the same port; the router's health
  checks take it out of rotation meanwhile (its ``/health`` lists each worker), and its
  in-flight requests end (streams are cut, never hung); one that keeps dying stops the server;
- SIGTERM or SIGINT drains: the router and every replica stop taking requests and finish
  those in flight (``--shutdown-timeout``), then this process exits 0; a second signal stops
  them at once.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedrs.cli_args import flags_from_args
from pagedrs.config import EngineConfig
from pagedrs.server.settings import ServerConfig

logger = logging.getLogger("pagedrs.server")

# Flags of the front that a replica does not take: it binds its own loopback port.
FRONT_ONLY = ("data_parallel_size", "router_policy", "host", "port")
# A replica that exits this many times within RESTART_WINDOW seconds is not restarted again.
MAX_RESTARTS = 5
RESTART_WINDOW = 120.0


def router_binary() -> str:
    """The ``pagedrs-router`` executable: built into the package (``make router``), on PATH,
    or in a source checkout's cargo target directory."""
    candidates = [Path(__file__).resolve().parents[1] / "bin" / "pagedrs-router"]
    on_path = shutil.which("pagedrs-router")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path(__file__).resolve().parents[3] / "target" / "release" / "pagedrs-router")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        "pagedrs-router is not built: run `make router` (cargo build --release -p pagedrs-router) or put it on PATH"
    )


def cpu_shares(cpus: list[int], count: int) -> list[list[int]]:
    """``cpus`` cut into ``count`` contiguous shares, as even as they go."""
    if len(cpus) < count:
        raise ValueError(f"--data-parallel-size {count} needs at least {count} CPU cores, this process has {len(cpus)}")
    size, extra = divmod(len(cpus), count)
    shares, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        shares.append(cpus[start:end])
        start = end
    return shares


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Replica:
    """One engine replica: its process, port and share of the machine."""

    index: int
    port: int
    argv: list[str]
    env: dict[str, str]
    cpus: list[int] | None
    process: subprocess.Popen | None = None
    exits: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedrs.server", *self.argv, "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env,
            preexec_fn=functools.partial(_as_child, self.cpus),
        )

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False


def _as_child(cpus: list[int] | None) -> None:
    """Runs in a replica or the router before exec: its own process group, so a terminal's
    Ctrl-C reaches only the front (which passes one SIGTERM on: a second would stop them at
    once); SIGTERM when the front dies, so none outlives it; its cores."""
    os.setpgrp()
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def replica_layout(config: EngineConfig, count: int) -> list[tuple[dict[str, str], list[int] | None]]:
    """Each replica's environment and CPU cores: on GPUs ``tensor_parallel_size`` devices
    each (``CUDA_VISIBLE_DEVICES``); on the CPU a contiguous share of this process's cores,
    with one thread per core for each of its ranks."""
    device = config.torch_device()
    base = dict(os.environ)
    if device.type == "cuda":
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        needed = count * config.tensor_parallel_size
        if len(devices) < needed:
            raise ValueError(
                f"--data-parallel-size {count} x --tensor-parallel-size {config.tensor_parallel_size} needs "
                f"{needed} GPUs, {len(devices)} are visible"
            )
        per = config.tensor_parallel_size
        return [
            ({**base, "CUDA_VISIBLE_DEVICES": ",".join(devices[i * per : (i + 1) * per])}, None) for i in range(count)
        ]
    shares = cpu_shares(sorted(os.sched_getaffinity(0)), count)
    layout: list[tuple[dict[str, str], list[int] | None]] = []
    for share in shares:
        env = dict(base)
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(share) // config.tensor_parallel_size)))
        layout.append((env, share))
    return layout


def serve_data_parallel(args: argparse.Namespace, config: EngineConfig, server: ServerConfig) -> int:
    """Starts the replicas and the router, supervises them until a signal, then drains;
    the exit status (0 after a drain, 1 when the router or a replica could not go on)."""
    from pagedrs.server.launch import add_serve_arguments

    count = server.data_parallel_size
    router_binary()  # not built: say so before any replica loads a model
    argv = flags_from_args(add_serve_arguments(argparse.ArgumentParser()), args, skip=FRONT_ONLY)
    replicas = [
        Replica(index, free_port(), argv, env, cpus) for index, (env, cpus) in enumerate(replica_layout(config, count))
    ]
    received: list[int] = []

    def on_signal(number: int, _frame: Any) -> None:
        received.append(number)
        name = signal.Signals(number).name
        logger.info("%s: %s", name, "draining every replica" if len(received) == 1 else "stopping every replica now")
        for process in [router, *(replica.process for replica in replicas)]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)

    router: subprocess.Popen | None = None
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for replica in replicas:
            replica.start()
            where = replica.cpus if replica.cpus is not None else replica.env.get("CUDA_VISIBLE_DEVICES")
            logger.info("replica %d on %s (%s)", replica.index, replica.url, where)
        if not _wait_until_up(replicas, received):
            return 1 if not received else 0
        router = _start_router(server, replicas)
        while True:
            if received and router.poll() is not None and not any(replica.running() for replica in replicas):
                return 0
            if router.poll() is not None and not received:
                logger.error("exiting: the router exited with status %s", router.returncode)
                return 1
            for replica in replicas:
                if not received and not replica.running() and not _restart(replica):
                    return 1
            time.sleep(0.2)
    finally:
        for process in [router, *(replica.process for replica in replicas)]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + server.shutdown_timeout + 10
        for process in [router, *(replica.process for replica in replicas)]:
            if process is not None:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()


def _wait_until_up(replicas: list[Replica], received: list[int]) -> bool:
    """Waits for every replica's ``/health``; False when one exited first (or a signal came)."""
    pending = list(replicas)
    while pending and not received:
        for replica in list(pending):
            if not replica.running():
                logger.error("exiting: replica %d exited while starting", replica.index)
                return False
            if replica.healthy():
                pending.remove(replica)
        time.sleep(0.2)
    return not pending


def _restart(replica: Replica) -> bool:
    """Restarts a replica that exited; False once it has exited too often."""
    assert replica.process is not None
    now = time.monotonic()
    replica.exits = [moment for moment in replica.exits if now - moment < RESTART_WINDOW] + [now]
    code, pid = replica.process.returncode, replica.process.pid
    if len(replica.exits) > MAX_RESTARTS:
        logger.error("exiting: replica %d exited %d times in %.0f s", replica.index, len(replica.exits), RESTART_WINDOW)
        return False
    logger.warning("replica %d (pid %d) exited with status %s: restarting it", replica.index, pid, code)
    replica.start()
    return True


def _start_router(server: ServerConfig, replicas: list[Replica]) -> subprocess.Popen:
    """Starts ``pagedrs-router`` in front of the replicas and returns once it listens; its
    output is passed on to this process's."""
    command = [router_binary(), "--host", server.host, "--port", str(server.port), "--policy", server.router_policy]
    # The router outlasts the replicas' drain, so it passes on what they end their streams with.
    command += ["--shutdown-timeout", str(server.shutdown_timeout + 5)]
    for replica in replicas:
        command += ["--worker", replica.url]
    router = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=functools.partial(_as_child, None),
    )
    assert router.stdout is not None
    for line in router.stdout:
        sys.stdout.write(line)
        if "listening on" in line:
            break
    else:
        raise RuntimeError(f"pagedrs-router exited with status {router.wait()} before listening")
    sys.stdout.flush()
    threading.Thread(target=_pass_on, args=(router.stdout,), daemon=True).start()
    where = f"http://{server.host}:{server.port}"
    logger.info("serving %d replicas on %s (router policy %s)", len(replicas), where, server.router_policy)
    return router


def _pass_on(stream: Any) -> None:
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
