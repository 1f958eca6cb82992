"""How a tensor-parallel step message should travel from rank 0 to a worker on one machine:
gloo broadcasts (what `pagedrs.engine.parallel` does: a fixed header, then the packed arrays),
or shared memory with a semaphore to say "a step is there" (what vLLM's message queue does,
with spinning instead of a semaphore).

Two processes (rank 0 and one worker). For each message size (a decode step of 1 and of 32
sequences, a 2048-token prefill), medians over ``--messages`` messages of:

- ``send_us``: rank 0's cost to hand one message over (what every step pays on the critical
  path before rank 0's own forward pass);
- ``round_trip_us``: the message to the worker and a one-word answer back (latency, both ways).

    .venv/bin/python benches/bench_step_broadcast.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

from pagedrs.engine.step_arrays import StepArrays
from pagedrs.engine.tp_common import HEADER_LEN, pack_step

SHM_BYTES = 1 << 22


def step(num_seqs: int, tokens_per_seq: int, blocks_per_seq: int) -> StepArrays:
    num_tokens = num_seqs * tokens_per_seq
    return StepArrays(
        np.arange(num_tokens, dtype=np.int64),
        np.arange(num_tokens, dtype=np.int64),
        np.arange(num_tokens, dtype=np.int64),
        np.arange(num_seqs + 1, dtype=np.int32),
        np.arange(num_seqs, dtype=np.int32),
        np.zeros((num_seqs, blocks_per_seq), np.int32),
        np.arange(num_seqs, dtype=np.int64),
        np.zeros((0, 2), np.int64),
    )


MESSAGES = {
    "decode, 1 sequence": step(1, 1, 8),
    "decode, 32 sequences": step(32, 1, 16),
    "prefill, 2048 tokens": step(1, 2048, 128),
}


def gloo_rank(rank: int, port: int, count: int, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    answer = torch.zeros(1, dtype=torch.int64)
    for name, arrays in MESSAGES.items():
        header, payload = pack_step(arrays)
        sends, trips = [], []
        for i in range(count):
            start = time.perf_counter()
            if rank == 0:
                dist.broadcast(torch.from_numpy(header), src=0)
                dist.broadcast(torch.from_numpy(payload), src=0)
                sent = time.perf_counter()
                dist.broadcast(answer, src=1)
                sends.append(sent - start)
                trips.append(time.perf_counter() - start)
            else:
                received = torch.empty(HEADER_LEN, dtype=torch.int64)
                dist.broadcast(received, src=0)
                body = torch.empty(int(received[1]), dtype=torch.uint8)
                dist.broadcast(body, src=0)
                answer[0] = i
                dist.broadcast(answer, src=1)
        if rank == 0:
            results.put(("gloo broadcast", name, statistics.median(sends), statistics.median(trips), payload.nbytes))
    # For scale: one all-reduce of a decode token's hidden state (the default model's 576
    # floats), which a forward pass does twice per layer.
    hidden = torch.ones(576)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        dist.all_reduce(hidden)
        times.append(time.perf_counter() - start)
    if rank == 0:
        median = statistics.median(times)
        results.put(("gloo all_reduce (for scale)", "576 float32", median, median, hidden.numel() * 4))
    dist.destroy_process_group()


def shm_worker(name: str, ready, done, count: int) -> None:
    memory = shared_memory.SharedMemory(name)
    header = np.ndarray(HEADER_LEN, np.int64, memory.buf)
    for _ in MESSAGES:
        for _ in range(count):
            ready.acquire()
            np.array(memory.buf[header.nbytes : header.nbytes + int(header[1])])  # the worker's copy
            done.release()
    del header
    memory.close()


def shm_rank0(count: int, results) -> None:
    context = multiprocessing.get_context("spawn")
    memory = shared_memory.SharedMemory(create=True, size=SHM_BYTES)
    ready, done = context.Semaphore(0), context.Semaphore(0)
    worker = context.Process(target=shm_worker, args=(memory.name, ready, done, count))
    worker.start()
    header_view = np.ndarray(HEADER_LEN, np.int64, memory.buf)
    for name, arrays in MESSAGES.items():
        sends, trips = [], []
        for _ in range(count):
            start = time.perf_counter()
            header, payload = pack_step(arrays)
            memory.buf[header.nbytes : header.nbytes + payload.nbytes] = payload.tobytes()
            header_view[:] = header
            ready.release()
            sent = time.perf_counter()
            done.acquire()
            sends.append(sent - start)
            trips.append(time.perf_counter() - start)
        results.put(("shared memory + semaphore", name, statistics.median(sends), statistics.median(trips), 0))
    worker.join()
    del header_view
    memory.close()
    memory.unlink()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [context.Process(target=gloo_rank, args=(rank, port, args.messages, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    shm_rank0(args.messages, results)
    rows = []
    while not results.empty():
        rows.append(results.get())
    for method, name, send, trip, size in sorted(rows, key=lambda row: (row[1], row[0])):
        record = {"message": name, "method": method, "send_us": round(send * 1e6, 1)}
        record["round_trip_us"] = round(trip * 1e6, 1)
        if size:
            record["payload_bytes"] = size
        print(json.dumps(record))


if __name__ == "__main__":
    main()
