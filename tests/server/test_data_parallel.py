"""``pagedrs serve --data-parallel-size 2`` on loopback: two engine replicas behind the Rust
router. Through the official ``openai`` client a shared-prefix multi-turn workload gives one
engine's greedy outputs, and cache-aware routing finds more of it cached than round-robin; a
replica SIGKILLed mid-run loses no request that had not started (retried on the other) and
ends its streams instead of hanging, and is restarted; SIGTERM drains both replicas."""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest

from pagedrs import LLM, SamplingParams
from tests.helpers.servers import Server, alive, child_pids, command_line, start_server, start_streams, stream, wait_for

pytestmark = pytest.mark.slow  # server processes

SYSTEMS = [
    "You are a careful assistant for a bakery. " * 12,
    "You answer questions about trains and timetables. " * 12,
    "You are a terse assistant that writes haiku. " * 12,
]
QUESTIONS = ["What do you recommend?", "Why?", "Say it again, shorter."]


def _conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": system}] for system in SYSTEMS for _ in range(2)]


def _replica_urls(front: Server) -> list[str]:
    status, workers = front.request("GET", "/workers")
    assert status == 200, workers
    return [worker["url"] for worker in workers["workers"]]


def _prefix_hit_rate(urls: list[str]) -> float:
    hits = queries = 0.0
    for url in urls:
        metrics = Server(process=None, port=int(url.rsplit(":", 1)[1]), log_path="").metrics()
        hits += metrics["pagedrs:prefix_cache_hits_total"]
        queries += metrics["pagedrs:prefix_cache_queries_total"]
    return hits / queries


def _run_conversations(front: Server, model: str) -> list[list[str]]:
    client = openai.OpenAI(base_url=f"{front.base_url}/v1", api_key="unused", max_retries=0)
    replies: list[list[str]] = []
    for messages in _conversations():
        said = []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
            text = answer.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            said.append(text)
        replies.append(said)
    return replies


def test_two_replicas_give_one_engines_outputs_and_cache_aware_routing_finds_more_cached(tiny_smol, tmp_path):
    llm = LLM(tiny_smol, kv_cache_memory="4MiB")
    expected = []
    for messages in _conversations():
        said = []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            text = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0].text
            messages.append({"role": "assistant", "content": text})
            said.append(text)
        expected.append(said)
    hit_rates = {}
    for policy in ("cache_aware", "round_robin"):
        front = start_server(
            [tiny_smol, "-dp", "2", "--router-policy", policy, "--kv-cache-memory", "4MiB"],
            str(tmp_path / f"{policy}.log"),
        )
        try:
            assert _run_conversations(front, tiny_smol) == expected
            hit_rates[policy] = _prefix_hit_rate(_replica_urls(front))
        finally:
            front.process.send_signal(signal.SIGTERM)
            assert front.process.wait(60) == 0, front.log()[-3000:]
    print(f"prefix-cache hit rate: {hit_rates}")
    assert hit_rates["cache_aware"] > hit_rates["round_robin"]


def _replica_pid(front_pid: int, port: int) -> int:
    for pid in child_pids(front_pid):
        argv = command_line(pid).split("\0")
        if "pagedrs.server" in argv and argv[argv.index("--port") + 1] == str(port):
            return pid
    raise AssertionError(f"no replica on port {port}")


def test_a_replica_killed_mid_run_loses_no_request_and_is_restarted(tiny_smol, tmp_path):
    front = start_server(
        [tiny_smol, "-dp", "2", "--router-policy", "round_robin", "--kv-cache-memory", "4MiB"],
        str(tmp_path / "front.log"),
    )
    try:
        urls = _replica_urls(front)
        pool, futures = start_streams(front.port, 4, max_tokens=500)
        killed = _replica_pid(front.process.pid, int(urls[0].rsplit(":", 1)[1]))
        os.kill(killed, signal.SIGKILL)
        # Requests sent now reach the survivor: refused connections are retried there.
        for _ in range(6):
            result = stream(front.port, max_tokens=4)
            assert result["status"] == 200 and result["finish"] == "length" and not result["errors"], result
        results = [future.result(timeout=120) for future in futures]
        pool.shutdown()
        cut = [r for r in results if r["finish"] != "length"]
        # Round-robin put two streams on each replica: the killed one's end with the router's
        # error event, the others run to their end.
        assert len(cut) == 2, results
        assert all("the worker failed mid-stream" in r["errors"][0]["message"] for r in cut), cut
        # The supervisor restarts the replica; the router takes it back once it is healthy.
        assert wait_for(lambda: _all_healthy(front), timeout=240, interval=0.5), front.log()[-3000:]
        assert _replica_pid(front.process.pid, int(urls[0].rsplit(":", 1)[1])) != killed
        assert "restarting" in front.log()
    finally:
        front.process.send_signal(signal.SIGTERM)
        assert front.process.wait(60) == 0, front.log()[-3000:]


def _all_healthy(front: Server) -> bool:
    status, workers = front.request("GET", "/workers")
    return status == 200 and all(worker["healthy"] for worker in workers["workers"])


def test_sigterm_drains_every_replica_then_exits_0(tiny_smol, tmp_path):
    front = start_server([tiny_smol, "-dp", "2", "--kv-cache-memory", "4MiB"], str(tmp_path / "front.log"))
    children = child_pids(front.process.pid)
    pool, futures = start_streams(front.port, 4, max_tokens=400)
    start = time.monotonic()
    front.process.send_signal(signal.SIGTERM)
    results = [future.result(timeout=120) for future in futures]
    pool.shutdown()
    assert all(r["finish"] == "length" and r["done"] and not r["errors"] for r in results), json.dumps(results)
    assert front.process.wait(60) == 0, front.log()[-3000:]
    print(f"drained and exited in {time.monotonic() - start:.2f} s")
    assert len(children) == 3  # the router and two replicas
    assert wait_for(lambda: not any(alive(pid) for pid in children), timeout=10)
